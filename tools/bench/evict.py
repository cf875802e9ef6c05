"""Per-eviction cost against the number of blocks a store holds.

    kvstore bench evict [--blocks 10000 1000000] [--out DIR]

For each size, fills a store with that many small blocks through ``put`` (one
layer of 4-token rows, 2 KiB a block, so the filling is cheap and eviction
bookkeeping is what is measured), then evicts one block at a time and reports the median time
of one eviction:

- RAM: ``trim_ram`` to one block less than held, on a RAM-only store;
- disk: ``trim_disk`` by 64 KiB at a time (about 16 blocks: each round is one
  LMDB transaction, whose commit dominates), on an SSD store reopened from its file
  (the index rebuilt at open, as after a restart); time per evicted block.

Flat medians from 10K to 1M blocks mean eviction does not grow with the store.
Runs against older kvstore versions too (``--legacy`` reaches the private
eviction entry point they had), to give before/after figures from one tool.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore import KVLayer, PrefixStore

BLOCK = 4
PROMPT = 256  # tokens per put: chains of 64 blocks
DISK_STEP = 64 << 10  # bytes freed per timed disk round: LMDB counts usage in pages, a tiny block frees none


def _layers(n: int) -> list:
    # 4 tokens x 128 dims x fp16 x (K, V) = 2 KiB a block: each block takes LMDB overflow pages of its
    # own, so evicting one frees whole pages (tiny values share pages and free none)
    k = mx.zeros((1, 1, n, 128), dtype=mx.float16)
    return [KVLayer(k, k)]


def _fill(store: PrefixStore, blocks: int) -> float:
    t = time.perf_counter()
    layers = _layers(PROMPT)
    for i in range(-(-blocks * BLOCK // PROMPT)):
        toks = np.arange(PROMPT, dtype=np.int32) + i * PROMPT  # distinct prompts: all leaves are separate chains
        store.put("evict-bench", toks, layers)
        if i % 256 == 255:
            store.flush()
    store.flush()
    return time.perf_counter() - t


def _per_eviction(step, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def run(blocks: int, rounds: int, legacy: bool) -> dict:
    out: dict = {"blocks": blocks}
    ram = PrefixStore(budget_gb=8, block_size=BLOCK)
    out["ram_fill_s"] = _fill(ram, blocks)
    out["ram_blocks_indexed"] = len(ram)
    per_block = ram.nbytes // max(1, ram.stats()["ram_blocks"])
    times = _per_eviction(lambda: ram.trim_ram(ram.nbytes - per_block), rounds)
    out["ram_evictions"] = blocks - ram.stats()["ram_blocks"]
    out["ram_eviction_median_us"] = statistics.median(times) * 1e6
    ram.close()
    with tempfile.TemporaryDirectory(prefix="evict-bench-") as d:
        path = Path(d) / "store"
        with PrefixStore(budget_gb=8, block_size=BLOCK, ssd_path=path, disk_budget_gb=64) as s:
            out["ssd_fill_s"] = _fill(s, blocks)
        t = time.perf_counter()
        s = PrefixStore(budget_gb=0, block_size=BLOCK, ssd_path=path, disk_budget_gb=64)
        out["ssd_open_s"] = time.perf_counter() - t
        out["ssd_blocks_indexed"] = len(s)

        per_round = []

        def one():
            target = s.stats()["ssd_bytes"] - DISK_STEP
            before = s.stats()["evictions_ssd"]
            t = time.perf_counter()
            if legacy:
                s._evict_disk(target)  # before the split: the private entry point of that version
            else:
                s.trim_disk(target)
            per_round.append((time.perf_counter() - t) / max(1, s.stats()["evictions_ssd"] - before))
        disk_rounds = max(3, rounds // 20) if legacy and blocks > 100_000 else max(3, rounds // 4)
        _per_eviction(one, disk_rounds)
        out["ssd_evictions"] = s.stats()["evictions_ssd"]
        out["ssd_eviction_rounds"] = disk_rounds
        out["ssd_eviction_median_us"] = statistics.median(per_round) * 1e6
        s.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench evict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=200, help="single-block evictions timed per size")
    ap.add_argument("--legacy", action="store_true", help="measure a kvstore from before the split")
    ap.add_argument("--out", type=Path, default=None, help="write evict.json here")
    args = ap.parse_args(argv)
    results = []
    for n in args.blocks:
        r = run(n, args.rounds, args.legacy)
        print(json.dumps(r), flush=True)
        results.append(r)
    if len(results) > 1:
        a, b = results[0], results[-1]
        print(f"RAM: {b['ram_eviction_median_us'] / a['ram_eviction_median_us']:.2f}x per eviction from "
              f"{a['blocks']:,} to {b['blocks']:,} blocks; disk: "
              f"{b['ssd_eviction_median_us'] / a['ssd_eviction_median_us']:.2f}x")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "evict.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
