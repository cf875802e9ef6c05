"""What the store's Python objects cost the engine: a collection of Python's
garbage collector holds the GIL, so the engine's thread waits for every one,
whichever thread's allocations set it off (the writer's, mostly), and a full
collection walks every object the tiers hold:

    kvstore bench gc-pauses --tokens 32768 --puts 12 --out OUT/gc.json

``--puts`` prompts of their own (every block new), each stored through
``store_cache`` from an mlx-lm ``KVCache`` per layer (Llama-3-8B KV shape by
default) and flushed, into one RAM store large enough to keep them all.
Reports the collections of each generation during those puts (count, total
and longest pause, ms), the wall time, and the objects the collector tracks
per block held. Public API only: it runs on trees from before the change it
measures.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore import PrefixStore
from kvstore.adapters.generate import store_cache
from kvstore.tools.bench.common import write_json
from kvstore.tools.put_cost import engine_cache


def run(tokens: int, puts: int, layers: int, heads: int, dim: int) -> dict:
    events: list[tuple[str, int, float]] = []

    def record(phase: str, info: dict) -> None:
        events.append((phase, info["generation"], time.perf_counter()))

    cache = engine_cache(tokens, layers, heads, dim)
    kv_gb = puts * layers * 2 * heads * (tokens + 1) * dim * 2 / 1e9
    with PrefixStore(budget_gb=kv_gb * 1.2 + 1) as store:
        gc.collect()
        objects = len(gc.get_objects())
        gc.callbacks.append(record)
        t = time.perf_counter()
        try:
            for i in range(puts):
                ids = np.arange(5, tokens + 6, dtype=np.int32) + i * 1_000_000
                store_cache(store, "bench", ids, cache)
                store.flush()
        finally:
            wall = time.perf_counter() - t
            gc.callbacks.remove(record)
        pauses = [(g, (events[i + 1][2] - at) * 1e3) for i, (phase, g, at) in enumerate(events[:-1])
                  if phase == "start"]
        gc.collect()
        blocks = store.stats()["ram_blocks"]
        per_block = (len(gc.get_objects()) - objects) / max(1, blocks)
    out = {"tokens": tokens, "puts": puts, "layers": layers, "heads": heads, "dim": dim, "wall_s": round(wall, 3),
           "ram_blocks": blocks, "tracked_objects_per_block": round(per_block, 1),
           "date": time.strftime("%Y-%m-%d %H:%M"), "device": str(mx.default_device())}
    for g in (0, 1, 2):
        ms = [p for gen, p in pauses if gen == g]
        out[f"gen{g}"] = {"count": len(ms), "total_ms": round(sum(ms), 2), "longest_ms": round(max(ms, default=0), 2)}
    print(out, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench gc-pauses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--puts", type=int, default=12)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="write this JSON file")
    a = ap.parse_args(argv)
    write_json(a.out, run(a.tokens, a.puts, a.layers, a.heads, a.dim))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
