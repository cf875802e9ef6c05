"""A write storm far beyond the disk: what ``put`` blocks the engine's
thread, and what the store keeps (issue 42: no put over 50 ms on the CPU box):

    python -m kvstore.tools.put_storm --prompts 24 --mib 256 --budget-mib 512 --dir /tmp --out OUT

Prompts of ``--mib`` of fp16 KV each (an mlx-lm ``KVCache`` per layer, as an
engine hands them over: ``store_cache``), each with tokens of its own, put
back to back into a store with a RAM budget of ``--budget-mib`` and a disk
tier; then one flush. Reports each put's time on the caller's thread, what
was stored and skipped (``puts_skipped``), the seconds to flush, and, as the
disk's baseline, a plain write + fsync of the same bytes in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import PrefixStore
from kvstore.adapters.generate import store_cache

from .put_cost import engine_cache

LAYERS, HEADS, DIM = 32, 8, 128
PER_TOKEN = LAYERS * HEADS * DIM * 2 * 2  # fp16 K and V


def storm(prompts: int, mib: int, budget_mib: int, where: Path) -> dict:
    tokens = max(256, (mib << 20) // PER_TOKEN)
    cache = engine_cache(tokens, LAYERS, HEADS, DIM)  # (one cache, put under each prompt's own tokens)
    path = Path(tempfile.mkdtemp(dir=where, prefix="put-storm-"))
    try:
        with PrefixStore(budget_gb=budget_mib / 1024, ssd_path=path / "s", block_size=256) as s:
            ms = []
            for i in range(prompts):
                ids = np.arange(i * 1_000_000, i * 1_000_000 + tokens + 1, dtype=np.int32)
                t0 = time.perf_counter()
                store_cache(s, "storm", ids, cache)
                ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            s.flush()
            flush_s = time.perf_counter() - t0
            st = s.stats()
        plain = path / "plain"
        t0 = time.perf_counter()
        with open(plain, "wb") as f:
            block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
            for _ in range(max(1, st["ssd_bytes"] >> 26)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        plain_gbps = plain.stat().st_size / (time.perf_counter() - t0) / 1e9
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"prompts": prompts, "prompt_mib": tokens * PER_TOKEN / (1 << 20), "tokens": tokens,
            "budget_mib": budget_mib, "put_ms": [round(t, 3) for t in ms], "put_median_ms": float(np.median(ms)),
            "put_max_ms": max(ms), "puts_skipped": st.get("puts_skipped"), "blocks_skipped": st.get("blocks_skipped"),
            "puts_inline": st.get("puts_inline"),  # (trees before 2661ab0 ran such puts on the caller's thread)
            "blocks_stored": st["blocks_stored"], "ssd_bytes": st["ssd_bytes"], "flush_s": flush_s,
            "plain_write_fsync_gbps": plain_gbps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--mib", type=int, default=256, help="fp16 KV per prompt")
    ap.add_argument("--budget-mib", type=int, default=512, help="the RAM tier's budget")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the store is made")
    ap.add_argument("--out", type=Path, default=None, help="write put-storm.json here")
    a = ap.parse_args(argv)
    r = storm(a.prompts, a.mib, a.budget_mib, a.dir)
    print(f"{a.prompts} puts of {r['prompt_mib']:.0f} MiB: median {r['put_median_ms']:.2f} ms, max "
          f"{r['put_max_ms']:.2f} ms; skipped {r['puts_skipped']}; flush {r['flush_s']:.1f} s; "
          f"{r['ssd_bytes'] / 1e9:.2f} GB on disk (plain write+fsync {r['plain_write_fsync_gbps']:.2f} GB/s)")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "put-storm.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
