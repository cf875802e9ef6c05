"""What storing a prompt's cache blocks the engine's thread, through the
adapters (issue 28: put under 1 ms at 32K, the first put of a process
included):

    kvstore bench put-cost --tokens 32768 8192 --out OUT      # or python -m kvstore.tools.put_cost; writes OUT/put.json

An mlx-lm ``KVCache`` per layer (Llama-3-8B KV shape by default: 32 layers,
8 KV heads, dim 128, fp16) holding a prompt and one generated token, as a
cache is after a request: its buffers are larger than its rows. Every put is
of a prompt of its own (all its blocks new) into one RAM-only store, flushed
before the next is timed; the run's first (``first_put_of_process_ms``) is the
process's first put, and ``--first-puts K`` adds the first put of each of K
fresh processes (``first_puts_ms``; each opens a store, fetches the prompt,
a miss, as an engine's first request does, builds its cache and stores it).
``--pause S`` idles S seconds before each ``store_cache`` timed, as the
engine's thread does while the GPU runs a prefill (a put right after another
finds the CPU's caches warm). Medians of ``--repeats``:

- ``store_cache_ms``: ``adapters.generate.store_cache`` given int32 tokens
  (what ``generate`` passes), and ``store_cache_list_ms`` given a Python list;
- ``layers_ms`` / ``put_ms``: of the former, taking the layers from the
  cache and ``PrefixStore.put``;
- ``insert_ms``: what the server adapters' insert (mlx-lm's server and
  vllm-mlx) does on the engine's thread: the cache's token count, a snapshot
  of it and its ``async_eval``; the put runs on the inserts thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from kvstore import PrefixStore
from kvstore.adapters.generate import store_cache
from kvstore.adapters.mlx_lm import cache_offset, caches_to_layers, snapshot


def engine_cache(tokens: int, layers: int, heads: int, dim: int) -> list:
    """A prompt's cache after one generated token: ``tokens + 1`` rows in buffers of 256-row steps."""
    cache = []
    for _ in range(layers):
        c = C.KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        c.update_and_fetch(k, k)
        c.update_and_fetch(k[:, :, :1], k[:, :, :1])
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def run(tokens: list[int], repeats: int, layers: int, heads: int, dim: int, pause: float = 0.0) -> dict:
    rows, first = [], None
    with PrefixStore(budget_gb=12) as store:
        for n in tokens:
            cache = engine_cache(n, layers, heads, dim)
            t: dict[str, list[float]] = {k: [] for k in ("store_cache_ms", "store_cache_list_ms", "layers_ms",
                                                         "put_ms")}
            for rep in range(repeats):
                def ids(j: int) -> np.ndarray:  # a prompt of its own per put: every block is new
                    return np.arange(5, n + 6, dtype=np.int32) + (4 * rep + j) * 1_000_000
                a, listed, b = ids(0), ids(1).tolist(), ids(2)
                time.sleep(pause)
                t["store_cache_ms"].append(_timed(lambda: store_cache(store, "bench", a, cache)))
                first = t["store_cache_ms"][0] if first is None else first
                store.flush()
                t["store_cache_list_ms"].append(_timed(lambda: store_cache(store, "bench", listed, cache)))
                store.flush()
                got: dict = {}
                t["layers_ms"].append(_timed(lambda: got.update(layers=caches_to_layers([cache], copy=False))))
                t["put_ms"].append(_timed(lambda: store.put("bench", b[:got["layers"][0]], got["layers"][1])))
                store.flush()
            row = {"tokens": n, "layers": layers, "heads": heads, "dim": dim}
            for k, v in t.items():
                row[k] = statistics.median(v)
                row[k.replace("_ms", "_each_ms")] = [round(x, 3) for x in v]
            row["insert_ms"] = _insert(cache, repeats)
            rows.append(row)
            print(row, flush=True)
    return {"rows": rows, "first_put_of_process_ms": first, "pause_s": pause, "date": time.strftime("%Y-%m-%d %H:%M"),
            "device": str(mx.default_device())}


def _insert(cache: list, repeats: int) -> float:
    """Median ms of the engine-thread part of ``StorePromptCache._insert``."""
    def part() -> None:
        cache_offset(cache)
        _, arrays = snapshot(cache)
        mx.async_eval(arrays)
    return statistics.median(_timed(part) for _ in range(repeats))


def first_put(tokens: int, layers: int, heads: int, dim: int) -> float:
    """ms of this process's first ``store_cache``, after what an engine's
    first request does before it: a fetch of the prompt (a miss), then the
    prompt's cache."""
    with PrefixStore(budget_gb=12) as store:
        ids = np.arange(5, tokens + 6, dtype=np.int32)
        assert not store.fetch("bench", ids)
        cache = engine_cache(tokens, layers, heads, dim)
        return _timed(lambda: store_cache(store, "bench", ids, cache))


def first_puts(k: int, tokens: int, layers: int, heads: int, dim: int) -> list[float]:
    """The first put of each of ``k`` fresh processes."""
    cmd = [sys.executable, "-m", "kvstore.tools.put_cost", "--first-only", "--tokens", str(tokens),
           "--layers", str(layers), "--heads", str(heads), "--dim", str(dim)]
    return [float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])
            for _ in range(k)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench put-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 8192])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds idle before each store_cache timed")
    ap.add_argument("--first-puts", type=int, default=0, help="fresh processes to time a first put in")
    ap.add_argument("--first-only", action="store_true", help="print this process's first put (ms) and stop")
    ap.add_argument("--out", type=Path, default=None, help="write put.json here")
    a = ap.parse_args(argv)
    if a.first_only:
        print(round(first_put(a.tokens[0], a.layers, a.heads, a.dim), 3))
        return 0
    result = run(a.tokens, a.repeats, a.layers, a.heads, a.dim, a.pause)
    if a.first_puts:
        result["first_puts_ms"] = first_puts(a.first_puts, a.tokens[0], a.layers, a.heads, a.dim)
        print("first puts of fresh processes (ms):", result["first_puts_ms"], flush=True)
    if a.out is not None:  # (written here, not by bench.common: the tool also runs on trees from before it)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "put.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
