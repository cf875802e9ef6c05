"""`kvstore run -- ENGINE`: an engine built on mlx-lm, unchanged, on the store. The engine is a real process
(tests/_run_engine.py: mlx_lm.load + stream_generate, a fresh prompt cache per request or one kept and
trimmed across requests); what each request got from the store comes from $KVSTORE_RUN_REPORT."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.adapters.tiny_models import make_tiny_model

ENGINE = str(Path(__file__).parents[1] / "tools" / "run_engine.py")
SYSTEM = "You are a helpful assistant who answers briefly. " * 30  # ~720 tokens: 11 blocks of 64
LONG = SYSTEM + "tell me about the weather in many words " * 12  # ~900 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("run") / "model")


def engine(model, mode, *prompts, store=None, report=None, cmd=None):
    """The engine's answers (one dict per prompt): alone, or under `kvstore run --ssd-path store`."""
    argv = list(cmd or [sys.executable, ENGINE, str(model), mode, *prompts])
    env = dict(os.environ)
    if store is not None:
        argv = [sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(store), "--block-size", "64",
                "--budget-gb", "1", "--calibrate-budget-s", "0", "--", *argv]
        env["KVSTORE_RUN_REPORT"] = str(report)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line)["tokens"] for line in done.stdout.splitlines() if line.startswith("{")]


def report(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("mode", ["fresh", "keep"])
def test_answers_equal_the_engine_alone_and_later_requests_come_from_the_store(model, tmp_path, mode):
    """A second conversation sharing the system prompt and a new process repeating a prompt are served
    from the store (`fresh`: the whole shared prefix; `keep`: past what the engine's own cache holds)."""
    prompts = [LONG, SYSTEM + "how are you", LONG]
    alone = engine(model, mode, *prompts)
    store, rep = tmp_path / "store", tmp_path / "report.jsonl"
    assert engine(model, mode, *prompts, store=store, report=rep) == alone
    first, second, third = report(rep)
    assert first["store_tokens"] == 0 and first["computed_tokens"] == first["prompt_tokens"]
    if mode == "fresh":
        assert second["store_tokens"] >= 640  # the system prompt's whole blocks
        assert third["store_tokens"] == third["prompt_tokens"] - 1
    else:  # the engine trimmed its cache to the system prompt: the store adds the rest of LONG
        assert second["engine_tokens"] >= 700 and second["store_tokens"] == 0
        assert third["engine_tokens"] == second["engine_tokens"] and third["store_tokens"] >= 128
        assert third["engine_tokens"] + third["store_tokens"] == third["prompt_tokens"] - 1
    # a new engine process: everything but the last token from SSD
    assert engine(model, mode, LONG, store=store, report=rep) == engine(model, mode, LONG)
    assert report(rep)[-1]["store_tokens"] == report(rep)[-1]["prompt_tokens"] - 1


def test_another_model_is_never_served_this_models_kv(model, tmp_path):
    """The key is the loaded model's digest: a model of other weights on the same store gets nothing."""
    other = make_tiny_model("llama", tmp_path / "other", seed=1)
    store, rep = tmp_path / "store", tmp_path / "report.jsonl"
    engine(model, "fresh", LONG, store=store, report=rep)
    assert engine(other, "fresh", LONG, store=store, report=rep) == engine(other, "fresh", LONG)
    assert report(rep)[-1]["store_tokens"] == 0
    assert report(rep)[-1]["model"] != report(rep)[0]["model"]


def test_a_cache_the_engine_filled_itself_is_left_alone(model, tmp_path):
    """Tokens a cache holds are known only for caches this process handed to generate_step: one the engine
    prefilled by calling the model itself runs as mlx-lm's own call (nothing fetched or stored)."""
    code = ("import sys, mlx.core as mx; from mlx_lm import load, stream_generate; "
            "from mlx_lm.models.cache import make_prompt_cache; m, t = load(sys.argv[1]); ids = t.encode(sys.argv[2]); "
            "c = make_prompt_cache(m); m(mx.array(ids[:-1])[None], cache=c); "
            "print([r.token for r in stream_generate(m, t, ids[-1:], max_tokens=4, prompt_cache=c)])")
    rep = tmp_path / "report.jsonl"
    cmd = [sys.executable, "-c", code, str(model), LONG]
    subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(tmp_path / "s"), "--",
                    *cmd], check=True, env=dict(os.environ, KVSTORE_RUN_REPORT=str(rep)), capture_output=True)
    assert not rep.exists()


def test_exit_status_passes_through_and_bad_options_are_refused(tmp_path):
    run = [sys.executable, "-m", "kvstore.adapters.cli", "run"]
    assert subprocess.run([*run, "--ssd-path", str(tmp_path), "--", sys.executable, "-c",
                           "import sys; sys.exit(3)"]).returncode == 3
    bad = subprocess.run([*run, "--ssd-pat", str(tmp_path), "--", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--ssd-pat" in bad.stderr
    none = subprocess.run([*run, "--ssd-path", str(tmp_path)], capture_output=True, text=True)
    assert none.returncode == 2 and "no command to run" in none.stderr


def _openai_server():
    try:
        from importlib.metadata import version

        return version("mlx-openai-server")
    except Exception:
        return None


@pytest.mark.skipif(_openai_server() is None, reason="mlx-openai-server not installed (its lane: .ci/run)")
def test_mlx_openai_server_restarted_is_served_from_the_store(model, tmp_path):
    """mlx-openai-server 1.8.1 (--disable-batching: its BatchGenerator path is not instrumented) under
    `kvstore run`: after a restart the repeated prompt comes from the store, answers equal it alone."""
    from .test_server import free_port

    def serve(under_run, log):
        port = free_port()
        cmd = ["mlx-openai-server", "launch", "--model-path", str(model), "--model-type", "lm", "--host",
               "127.0.0.1", "--port", str(port), "--disable-batching", "--no-log-file"]
        if under_run:
            cmd = [sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(tmp_path / "store"),
                   "--block-size", "64", "--calibrate-budget-s", "0", "--", *cmd]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=dict(os.environ, KVSTORE_RUN_REPORT=str(tmp_path / "report.jsonl")))
        return proc, port

    def ask(port):
        import time
        import urllib.request

        body = {"model": str(model), "messages": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": "hello there"}],
                "max_tokens": 8, "temperature": 0}
        deadline = time.time() + 180
        while True:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return json.load(r)["choices"][0]["message"]["content"]
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(1)

    answers = []
    with open(tmp_path / "server.log", "wb") as log:
        for under_run in (False, True, True):
            proc, port = serve(under_run, log)
            try:
                answers.append(ask(port))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    assert answers[1] == answers[0] and answers[2] == answers[0]
    first, again = report(tmp_path / "report.jsonl")
    assert first["store_tokens"] == 0
    assert again["store_tokens"] == again["prompt_tokens"] - 1 and again["engine_tokens"] == 0


@pytest.mark.parametrize("kind", ["qwen3_next", "gemma3_text"])
def test_caches_that_cannot_be_trimmed_share_a_system_prompt_through_block_snapshots(tmp_path, kind):
    """Recurrent state (qwen3_next) and sliding windows (gemma3_text): the prompt is prefilled in chunks
    ending on block boundaries, each offered to the store, so a second conversation sharing only the
    system prompt starts from the last boundary inside it."""
    model = make_tiny_model(kind, tmp_path / kind)
    prompts = [LONG, SYSTEM + "how are you"]
    rep = tmp_path / "report.jsonl"
    assert engine(model, "fresh", *prompts, store=tmp_path / "store", report=rep) == engine(model, "fresh", *prompts)
    assert report(rep)[1]["store_tokens"] >= 640
