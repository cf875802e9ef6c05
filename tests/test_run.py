"""`kvstore run -- ENGINE`: an engine built on mlx-lm, unchanged, on the store. The engine is a real process
(tools/bench/run_engine.py: mlx_lm.load + stream_generate, a fresh prompt cache per request or one kept and
trimmed across requests); what each request got from the store comes from $KVSTORE_RUN_REPORT."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.adapters.tiny_models import make_tiny_model

ENGINE = str(Path(__file__).parents[1] / "tools" / "bench" / "run_engine.py")
BATCH_ENGINE = str(Path(__file__).parents[1] / "tools" / "bench" / "run_batch_engine.py")  # mlx-lm's BatchGenerator
SYSTEM = "You are a helpful assistant who answers briefly. " * 30  # ~720 tokens: 11 blocks of 64
LONG = SYSTEM + "tell me about the weather in many words " * 12  # ~900 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("run") / "model")


def engine(model, mode, *prompts, store=None, report=None, cmd=None, script=ENGINE, full=False):
    """The engine's answers (one list of tokens per prompt; ``full``: the engine's whole line, with its
    first-token time): alone, or under `kvstore run --ssd-path store`."""
    argv = list(cmd or [sys.executable, script, str(model), mode, *prompts])
    env = dict(os.environ)
    if store is not None:
        argv = [sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(store), "--block-size", "64",
                "--budget-gb", "1", "--calibrate-budget-s", "0", "--", *argv]
        env["KVSTORE_RUN_REPORT"] = str(report)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return lines if full else [line["tokens"] for line in lines]


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
    # a new engine process: everything but the last token from SSD, the answer the engine gave LONG alone (its
    # first request there, as here)
    assert engine(model, mode, LONG, store=store, report=rep) == alone[:1]
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


def chat(port, model, user):
    """A greedy chat completion (the system prompt and ``user``) from the server at ``port``, once it answers."""
    import time
    import urllib.request

    body = {"model": str(model), "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
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
            time.sleep(0.5)


def _openai_server():
    try:
        from importlib.metadata import version

        return version("mlx-openai-server")
    except Exception:
        return None


@pytest.mark.skipif(_openai_server() is None, reason="mlx-openai-server not installed (its lane: .ci/run)")
@pytest.mark.parametrize("batching", [False, True])
def test_mlx_openai_server_restarted_is_served_from_the_store(model, tmp_path, batching):
    """mlx-openai-server 1.8.1 under `kvstore run`, with continuous batching (mlx-lm's BatchGenerator) or
    without (`--disable-batching`: stream_generate): after a restart the repeated prompt comes from the
    store, answers equal it alone."""
    from .test_server import free_port

    def serve(under_run, log):
        port = free_port()
        cmd = ["mlx-openai-server", "launch", "--model-path", str(model), "--model-type", "lm", "--host",
               "127.0.0.1", "--port", str(port), "--no-log-file"] + ([] if batching else ["--disable-batching"])
        if under_run:
            cmd = [sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(tmp_path / "store"),
                   "--block-size", "64", "--calibrate-budget-s", "0", "--", *cmd]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=dict(os.environ, KVSTORE_RUN_REPORT=str(tmp_path / "report.jsonl")))
        return proc, port

    answers = []
    with open(tmp_path / "server.log", "wb") as log:
        for under_run in (False, True, True):
            proc, port = serve(under_run, log)
            try:
                answers.append(chat(port, model, "hello there"))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    assert answers[1] == answers[0] and answers[2] == answers[0]
    first, again = report(tmp_path / "report.jsonl")
    assert [first.get("batch", False), again.get("batch", False)] == [batching, batching]  # the path asked for
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


SHORT = "what is two plus two"


@pytest.mark.parametrize("mode", ["fresh", "keep"])
def test_batch_generator_answers_equal_the_engine_alone_and_later_requests_come_from_the_store(model, tmp_path,
                                                                                               mode):
    """mlx-lm's BatchGenerator, several prompts inserted at once (tools/bench/run_batch_engine.py): `fresh` inserts
    them with no caches; `keep` hands each its nearest cache from mlx-lm's LRUPromptCache (one entry) with
    the tokens it holds, as mlx-lm's server does. The store fills each cache past what it holds, and a
    finished sequence's cache is stored: a later round and a new process are served from it."""
    rounds = [LONG, SHORT, SYSTEM + "how are you", "--", LONG, SYSTEM + "and what now"]
    alone = engine(model, mode, *rounds, script=BATCH_ENGINE)
    store, rep = tmp_path / "store", tmp_path / "report.jsonl"
    assert engine(model, mode, *rounds, store=store, report=rep, script=BATCH_ENGINE) == alone
    warm, *first, long2, system2 = report(rep)  # one line per sequence, at its first token
    assert all(r["batch"] for r in report(rep))
    assert [r["store_tokens"] for r in first] == [0, 0, 0]  # inserted together: none was stored yet
    if mode == "fresh":
        assert long2["engine_tokens"] == 0 and long2["store_tokens"] == long2["prompt_tokens"] - 1
        assert system2["store_tokens"] >= 640  # the system prompt's whole blocks
    else:  # the engine's LRU kept SYSTEM + "how are you": the store adds the rest of LONG past it
        assert long2["engine_tokens"] >= 700 and long2["store_tokens"] >= 128
        assert long2["engine_tokens"] + long2["store_tokens"] == long2["prompt_tokens"] - 1
        assert system2["engine_tokens"] >= 700
    # a new engine process: everything but the last token from SSD, answers the engine's own
    assert engine(model, mode, LONG, SHORT, store=store, report=rep, script=BATCH_ENGINE) == alone[:2]
    again = report(rep)[-2]
    assert again["engine_tokens"] + again["store_tokens"] == again["prompt_tokens"] - 1
    assert again["store_tokens"] >= again["prompt_tokens"] - 2


def test_batch_generator_first_token_from_the_store_is_under_a_third_of_cold(model, tmp_path):
    """A ~1,540-token system prompt through BatchGenerator (each round: it and a short unrelated prompt
    inserted at once): a second round sharing it, and a new process repeating the first round, get their
    first token in <= 0.3x of the cold round's time."""
    system = "You are a helpful assistant who answers briefly. " * 64
    first, x = system + "Say hello.", "Name a colour."
    store, rep = tmp_path / "store", tmp_path / "report.jsonl"
    run1 = engine(model, "fresh", first, x, "--", system + "How are you today?", SHORT, store=store, report=rep,
                  script=BATCH_ENGINE, full=True)
    run2 = engine(model, "fresh", first, x, store=store, report=rep, script=BATCH_ENGINE, full=True)
    cold, shared, again = run1[0]["ttft_s"], run1[2]["ttft_s"], run2[0]["ttft_s"]
    assert run1[0]["prompt_tokens"] >= 1500 and run2[0]["tokens"] == run1[0]["tokens"]
    lines = report(rep)
    assert lines[1]["store_tokens"] == 0 and lines[3]["store_tokens"] >= 1472 and lines[6]["store_tokens"] >= 1500
    assert shared <= 0.3 * cold and again <= 0.3 * cold, (cold, shared, again)


def test_a_batch_generator_kvstore_does_not_know_is_left_as_it_is(capsys):
    """What kvstore relies on in BatchGenerator is checked when mlx_lm.generate is instrumented: an mlx-lm
    whose insert_segments takes other arguments keeps its own, with a warning naming the difference."""
    import importlib
    import types

    from kvstore.adapters.run_patch import batch_mismatch, instrument_batch

    g = importlib.import_module("mlx_lm.generate")
    assert batch_mismatch(g) is None

    class Other(g.BatchGenerator):
        def insert_segments(self, prompts, caches=None):
            return super().insert_segments(prompts, caches=caches)

    module = types.SimpleNamespace(BatchGenerator=Other, GenerationBatch=g.GenerationBatch)
    assert "insert_segments" in batch_mismatch(module)
    assert instrument_batch(module) is False
    assert getattr(Other.insert_segments, "__wrapped__", None) is None
    assert "BatchGenerator is not instrumented" in capsys.readouterr().err


def test_mlx_lm_server_with_continuous_batching_restarted_is_served_from_the_store(model, tmp_path):
    """mlx-lm's own server (BatchGenerator, its LRU prompt cache) under `kvstore run`: a second request
    sharing the system prompt comes from its LRU or the store, the same requests after a restart from the
    store (the LRU starts empty); answers equal the server alone."""
    from .test_server import free_port

    answers = []
    with open(tmp_path / "server.log", "wb") as log:
        for under_run in (False, True, True):
            port = free_port()
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(port)]
            if under_run:
                cmd = [sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(tmp_path / "store"),
                       "--block-size", "64", "--calibrate-budget-s", "0", "--", *cmd]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                    env=dict(os.environ, KVSTORE_RUN_REPORT=str(tmp_path / "report.jsonl")))
            try:
                answers.append([chat(port, model, "hello there"), chat(port, model, "how are you")])
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    assert answers[1] == answers[0] and answers[2] == answers[0]
    lines = report(tmp_path / "report.jsonl")
    first, shared, again, shared_again = lines
    assert first["batch"] and first["store_tokens"] == 0, lines
    # (the server answers before it puts the finished cache in its LRU: a quick client can miss it there)
    assert shared["engine_tokens"] + shared["store_tokens"] >= 700, lines
    assert again["engine_tokens"] == 0 and again["store_tokens"] == again["prompt_tokens"] - 1, lines
    assert shared_again["engine_tokens"] + shared_again["store_tokens"] >= 700, lines


def test_batch_generator_caches_that_cannot_be_trimmed_are_left_to_mlx_lm(tmp_path):
    """Recurrent state (qwen3_next) in BatchGenerator: no block snapshots are taken inside a batch, so its
    prompts run as mlx-lm's own (nothing fetched or stored, no report line); answers unchanged."""
    model = make_tiny_model("qwen3_next", tmp_path / "qwen3_next")
    rep = tmp_path / "report.jsonl"
    prompts = [SYSTEM[:400], SHORT, "--", SYSTEM[:400]]  # ~100 tokens: whole blocks to store were it served
    assert engine(model, "fresh", *prompts, store=tmp_path / "store", report=rep, script=BATCH_ENGINE) == engine(
        model, "fresh", *prompts, script=BATCH_ENGINE)
    assert not rep.exists()
