"""A server on CUDA meets a new prompt shape on nearly every request, and mlx's
CUDA backend ends a process after about 500 of them (its attention-graph
cache throws "Cache thrashing is happening") unless
``MLX_ENABLE_CACHE_THRASHING_CHECK=0``, which importing kvstore sets where
the user has not (``kvstore.gpu.mlx_env``; docs/engines.md, "On CUDA: new
prompt shapes").

Any machine: every ``kvstore`` entry point has the variable set before mlx
loads, ``kvstore run``'s engine inherits it, and a value the user set wins.
CUDA only (skipped elsewhere; minutes on a GPU, not yet timed): ``kvstore serve``,
started as the command line starts it, answers 2,000 prompts of 2,000
distinct lengths in one process, each answer the same as mlx-lm's own server
gives without kvstore (mlx's defaults, a fresh process every 250 prompts, so
it never reaches the throw); and the same ``kvstore serve`` with the user's
``MLX_ENABLE_CACHE_THRASHING_CHECK=1`` fails on the way with mlx's error,
which shows the prompts reach the throw on this path.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.adapters.tiny_models import make_tiny_model
from kvstore.gpu import cuda
from kvstore.gpu.mlx_env import DEFAULTS
from kvstore.tools.servers import free_port, stop, wait_answering

VAR = "MLX_ENABLE_CACHE_THRASHING_CHECK"
CLI = [sys.executable, "-m", "kvstore.adapters.cli"]
not_on_macos = pytest.mark.skipif(sys.platform == "darwin", reason="nothing is set on macOS (Metal)")

# The value of VAR when mlx.core is first imported, in a process running the kvstore command of its arguments.
PROBE = r"""
import json, os, sys
seen = {}
class Probe:
    def find_spec(self, name, path, target=None):
        if name == "mlx.core" and not seen:
            seen["at_mlx_import"] = os.environ.get("MLX_ENABLE_CACHE_THRASHING_CHECK")
        return None
sys.meta_path.insert(0, Probe())
sys.argv = ["kvstore", *sys.argv[1:]]
try:
    from kvstore.adapters.cli import main
    main()
except SystemExit:
    pass
sys.stderr.write("PROBE " + json.dumps(seen) + "\n")
"""


def _env(value=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != VAR}  # (this process imported kvstore: it has VAR)
    if value is not None:
        env[VAR] = value
    return env


def _at_mlx_import(args, value=None):
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=_env(value),
                          timeout=180)
    line = [x for x in done.stderr.splitlines() if x.startswith("PROBE ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[-1][6:]).get("at_mlx_import", "mlx never imported")


@not_on_macos
@pytest.mark.parametrize("command", [["serve", "--help"], ["run", "--help"], ["omlx", "serve", "--help"],
                                     ["vllm-mlx", "serve", "--help"], ["inspect", "--help"]])
def test_each_entry_point_has_it_set_before_mlx_loads_and_a_users_value_wins(command):
    assert DEFAULTS == {VAR: "0"}
    assert _at_mlx_import(command) == "0"
    assert _at_mlx_import(command, "1") == "1"


@not_on_macos
def test_kvstore_run_hands_it_to_the_engine_and_a_users_value_wins(tmp_path):
    engine = [sys.executable, "-c", f"import os; print(os.environ.get({VAR!r}))"]
    for value, seen in ((None, "0"), ("1", "1")):
        done = subprocess.run([*CLI, "run", "--ssd-path", str(tmp_path / "store"), "--", *engine],
                              capture_output=True, text=True, env=_env(value), timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == [seen]


# --- on CUDA: 2,000 distinct prompt shapes through one kvstore serve ------------------------------------------

SHAPES = 2000
PER_REFERENCE_PROCESS = 250  # mlx-lm's server without kvstore, mlx's defaults: well under the ~500 that throw


def _prompts(n: int) -> list[str]:
    """``n`` prompts of ``n`` distinct lengths (one token a character, BOS first), shuffled, no two sharing a
    block's start (so no cache serves any of them: each is a whole prefill, in both servers)."""
    rng = random.Random(54)
    lengths = list(range(40, 40 + n))
    rng.shuffle(lengths)
    alphabet = string.ascii_letters + string.digits + " .,;"
    return ["".join(rng.choice(alphabet) for _ in range(n_chars)) for n_chars in lengths]


def _complete(port: int, prompt: str, timeout: float) -> str:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            got = json.load(r)
    except urllib.error.HTTPError as e:  # (mlx-lm's server sends an error's text as the body)
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None
    if "choices" not in got:
        raise RuntimeError(f"no answer: {json.dumps(got)[:300]}")
    return got["choices"][0]["text"]


def _answers(prompts, cmd, env, log_path, per_process=None, timeout=60.0) -> dict:
    """Each prompt's answer, in order, from servers started by ``cmd`` (a new one every ``per_process`` prompts),
    until one fails (HTTP error, timeout, exit)."""
    out = {"answers": [], "ms": [], "failure": None, "processes": 0}
    proc = port = None
    with open(log_path, "wb") as log:
        try:
            for i, prompt in enumerate(prompts):
                if proc is None or (per_process and i % per_process == 0):
                    if proc is not None:
                        stop(proc, 30)
                    port = free_port()
                    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                                            stderr=subprocess.STDOUT, env=env)
                    wait_answering(f"http://127.0.0.1:{port}/health", proc, 300)
                    out["processes"] += 1
                t = time.perf_counter()
                try:
                    out["answers"].append(_complete(port, prompt, timeout))
                except Exception as e:
                    out["failure"] = {"at": i, "error": repr(e)[:300], "exit": proc.poll()}
                    break
                out["ms"].append((time.perf_counter() - t) * 1e3)
                if (i + 1) % 250 == 0:  # (progress, with -s)
                    print(f"{log_path.stem}: {i + 1} answered, {sum(out['ms']) / 1e3:.0f} s in requests", flush=True)
            out["alive_at_end"] = proc.poll() is None
        finally:
            if proc is not None:
                stop(proc, 30)
                out["exit"] = proc.returncode
    return out


def _tail(path, n=3000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace")


@pytest.mark.skipif(cuda.runtime() is None, reason="needs mlx's CUDA backend")
def test_kvstore_serve_on_cuda_answers_2000_prompt_shapes_as_mlx_lm_does(tmp_path):
    model = str(make_tiny_model("llama", tmp_path / "model", vocab_size=128))  # character-level
    prompts = _prompts(SHAPES)
    kvstore = [*CLI, "serve", "--model", model, "--ssd-path", str(tmp_path / "store"), "--block-size", "64"]
    control = [*CLI, "serve", "--model", model, "--ssd-path", str(tmp_path / "control"), "--block-size", "64"]
    mlx_lm = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--prompt-cache-size", "0"]
    logs = {name: tmp_path / f"{name}.log" for name in ("kvstore", "mlx_lm", "control")}
    t = time.monotonic()
    with ThreadPoolExecutor(3) as pool:  # three processes on the GPU at once: a tiny model leaves it idle
        ours = pool.submit(_answers, prompts, kvstore, _env(), logs["kvstore"])  # VAR as the user left it: unset
        theirs = pool.submit(_answers, prompts, mlx_lm, _env("1"), logs["mlx_lm"], PER_REFERENCE_PROCESS)
        fused = pool.submit(_answers, prompts, control, _env("1"), logs["control"], None, 30.0)
        ours, theirs, fused = ours.result(), theirs.result(), fused.result()
    differ = [i for i, (a, b) in enumerate(zip(ours["answers"], theirs["answers"])) if a != b]
    summary = {"shapes": SHAPES, "wall_s": round(time.monotonic() - t, 1),
               "kvstore": {k: v for k, v in ours.items() if k not in ("answers", "ms")},
               "kvstore_ms_median": sorted(ours["ms"])[len(ours["ms"]) // 2] if ours["ms"] else None,
               "mlx_lm": {k: v for k, v in theirs.items() if k not in ("answers", "ms")},
               "mlx_lm_ms_median": sorted(theirs["ms"])[len(theirs["ms"]) // 2] if theirs["ms"] else None,
               "control_check_on": {k: v for k, v in fused.items() if k not in ("answers", "ms")},
               "answers_compared": min(len(ours["answers"]), len(theirs["answers"])), "answers_differ": len(differ),
               "distinct_answers": len(set(ours["answers"]))}
    print("NEW-SHAPES " + json.dumps(summary))
    assert ours["failure"] is None and ours["alive_at_end"] and ours["exit"] == 0, (summary, _tail(logs["kvstore"]))
    assert len(ours["answers"]) == SHAPES
    assert theirs["failure"] is None and len(theirs["answers"]) == SHAPES, (summary, _tail(logs["mlx_lm"]))
    assert not differ, [(i, ours["answers"][i], theirs["answers"][i]) for i in differ[:10]]
    assert fused["failure"] is not None, summary  # the user's setting wins, and these prompts meet the throw
    said = logs["control"].read_text(errors="replace") + fused["failure"]["error"]
    assert "Cache thrashing is happening" in said, (fused["failure"], _tail(logs["control"]))
