"""Where a RAM hit's time goes on a GPU, and what came before it changes (issue 28).

A long RAM hit took about 140 ms to its first token in some requests and
about 350 ms in others of the same benchmark. This serves one stored prompt
from RAM (``fetch_cache`` and the first token, as ``generate`` does) after
three kinds of request: another hit, a cold prefill of another prompt, and
mlx's buffer cache emptied; and times, inside each fetch, the blocks'
landing in GPU memory (copy engine, then copied out on the GPU) and
everything else. Run on the device machine::

    python3 -m kvstore.tools.ram_hit_profile --model /tmp/llama-8b --tokens 32768 --out OUT/ram_hit.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvstore.tools.bench.common import write_json


def run(model_path: str, tokens: int, repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from kvstore import PrefixStore
    from kvstore.convert import rowcopy
    from kvstore.adapters.calibration import vocab_size
    from kvstore.adapters.generate import fetch_cache, model_key, prefill, store_cache
    from mlx_lm.models import cache as C

    model, _ = load(model_path)
    key = model_key(model)
    rng = np.random.default_rng(0)
    vocab = min(1000, vocab_size([model]) or 1000)  # ids the model can embed (past its table: a crash on the CPU)
    prompt = rng.integers(0, vocab, tokens).tolist()
    other = rng.integers(0, vocab, tokens).tolist()
    uploads: list[float] = []  # per hit, the time its blocks took to land in GPU memory (copy engine + copy out)
    real = rowcopy._land

    def timed_land(*a):
        t = time.perf_counter()
        bad = real(*a)
        uploads.append(time.perf_counter() - t)
        return bad
    rowcopy._land = timed_land

    def cold(p) -> float:
        cache = C.make_prompt_cache(model)
        t = time.perf_counter()
        prefill(model, cache, p, 0, len(p))
        mx.eval([c.state for c in cache])
        return time.perf_counter() - t

    def hit(store) -> dict:
        uploads.clear()
        before = {"active_gb": mx.get_active_memory() / 1e9, "cache_gb": mx.get_cache_memory() / 1e9}
        mx.reset_peak_memory()
        t = time.perf_counter()
        got = fetch_cache(store, model, key, prompt)
        t_fetch = time.perf_counter() - t
        before["fetch_peak_gb"] = mx.get_peak_memory() / 1e9  # what the fetch held at most (cache and all)
        logits = model(mx.array(prompt[got.cached_tokens:])[None], cache=got.cache)
        mx.eval(mx.argmax(logits[:, -1, :]))
        total = time.perf_counter() - t
        return {**before, "fetch_ms": 1e3 * t_fetch, "upload_ms": 1e3 * sum(uploads), "first_token_ms": 1e3 * total,
                "cached": got.cached_tokens}

    out: dict = {"tokens": tokens, "device": str(mx.default_device()), "cold_ms": [], "after": {}}
    with PrefixStore(budget_gb=12, device_budget_gb=0, fetch_policy="always") as store:
        cache = C.make_prompt_cache(model)
        prefill(model, cache, prompt, 0, len(prompt))
        store_cache(store, key, prompt, cache)
        store.flush()
        del cache
        hit(store)  # kernels compiled
        for label in ("a_hit", "a_cold_prefill", "clear_cache"):
            rows = []
            for _ in range(repeats):
                if label == "a_hit":
                    hit(store)
                elif label == "a_cold_prefill":
                    out["cold_ms"].append(1e3 * cold(other))
                else:
                    mx.clear_cache()
                rows.append(hit(store))
            out["after"][label] = {"rows": rows, **{f"{k}_median": statistics.median(r[k] for r in rows)
                                                  for k in ("fetch_ms", "upload_ms", "first_token_ms")}}
            print(label, json.dumps({k: round(v, 1) for k, v in out["after"][label].items() if k != "rows"}),
                  flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res = run(args.model, args.tokens, args.repeats)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
