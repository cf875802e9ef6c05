"""First-token time of an unchanged mlx-lm engine under ``kvstore run``: cold, a second conversation
sharing the system prompt, and a new engine process repeating the prompt.

    kvstore bench run-ttft [--prefix 1536] [--layers 8] [--hidden 1024] [--batch] [--out FILE]

The engine is ``kvstore.tools.bench.run_engine`` (``mlx_lm.load`` + ``stream_generate``, a fresh prompt cache
per request) on a random-weight llama built by ``adapters/tiny_models.py``, large enough that prefill
dominates (float32: mlx's float16 matmuls are slow on CPU). Each process answers an unrelated warm-up prompt first (mlx's first-call costs), so ``cold`` is a
warm engine computing the whole prompt. The store has kvstore run's defaults (``fetch_policy="auto"``)
on a new directory. Answers are checked equal to the engine run alone.

``--batch``: the engine is ``kvstore.tools.bench.run_batch_engine`` (mlx-lm's ``BatchGenerator``, fresh caches,
its own warm-up round): each request goes in with a short unrelated prompt inserted at the same time, the
second conversation in a later round; first-token time from the round's insert.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstore.adapters.tiny_models import make_tiny_model
from kvstore.tools.bench.common import record


def _engine(model: Path, prompts: list[str], store: Path | None, report: Path, batch: bool = False) -> list[dict]:
    engine = "kvstore.tools.bench.run_batch_engine" if batch else "kvstore.tools.bench.run_engine"
    argv = [sys.executable, "-m", engine, str(model), "fresh", *prompts]
    if store is not None:
        argv = [sys.executable, "-m", "kvstore.adapters.cli", "run", "--ssd-path", str(store), "--", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, check=True,
                          env=dict(os.environ, KVSTORE_RUN_REPORT=str(report)))
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore bench run-ttft")
    p.add_argument("--prefix", type=int, default=1536, help="tokens of the shared system prompt (about)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", action="store_true", help="the engine: mlx-lm's BatchGenerator")
    p.add_argument("--out", type=Path, default=None,
                   help="a JSON file: this run goes under the engine's name (stream_generate, BatchGenerator)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model("llama", root / "model", hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                                num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256),
                                num_hidden_layers=a.layers, dtype="float32", torch_dtype="float32")
        system = "You are a helpful assistant who answers briefly. " * (a.prefix // 24)
        warm = ["Warm up with something else entirely. " * 8, "And once more, unrelated. " * 8]
        first, second = system + "Say hello.", system + "How are you today?"
        store, report = root / "store", root / "report.jsonl"
        if a.batch:  # [the warm-up round], first + a short one, then second + a short one: every other line
            x, y = "Name a colour.", "What is two plus two?"
            run1 = [None, *_engine(model, [first, x, "--", second, y], store, report, True)[::2]]
            run2 = [None, *_engine(model, [first, x], store, report, True)[::2]]
            alone = _engine(model, [first, x, "--", second, y], None, root / "none.jsonl", True)[::2]
        else:
            run1 = _engine(model, [warm[0], first, second], store, report)
            run2 = _engine(model, [warm[1], first], store, report)
            alone = _engine(model, [warm[0], first, second], None, root / "none.jsonl")[1:]
        got = [json.loads(line) for line in report.read_text().splitlines()]
        if a.batch:  # one line per sequence, warm-up rounds included: where the requests above are
            got = [None, got[1], got[3], None, got[6]]
        cold = run1[1]["ttft_s"]
        out = {
            "model": {"layers": a.layers, "hidden": a.hidden}, "engine": "BatchGenerator" if a.batch else
            "stream_generate", "prompt_tokens": run1[1]["prompt_tokens"],
            "cold_s": cold, "alone_s": alone[0]["ttft_s"], "shared_system_s": run1[2]["ttft_s"], "new_process_s": run2[1]["ttft_s"],
            "shared_system_ratio": run1[2]["ttft_s"] / cold, "new_process_ratio": run2[1]["ttft_s"] / cold,
            "store_tokens": {"shared_system": got[2]["store_tokens"], "new_process": got[4]["store_tokens"]},
            "answers_equal_alone": [run1[1]["tokens"], run1[2]["tokens"], run2[1]["tokens"]]
            == [alone[0]["tokens"], alone[1]["tokens"], alone[0]["tokens"]],
        }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        record(a.out, out["engine"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
