"""put: how long ``put`` blocks the caller for a long prompt's cache, and the
background throughput to SSD (fp16 and 8-bit entries) vs a plain file write."""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .common import (WRITE_CHUNK, GiB, MiB, fp16_nbytes, kv_layers, log, rand_tokens, random_chunk, stat,
                     timed_write)
from .settings import TARGETS

KEY = "bench-put"
BLOCK = 256


def _measured_put(path: Optional[Path], budget_gb: float, warm_tokens: np.ndarray, warm: list,
                  toks: np.ndarray, layers: list, kv_bits: Optional[int] = None):
    """A fresh store takes a first, short put of the model key (which registers
    the key in LMDB, a write transaction on the caller's thread, so it is timed
    apart), then the measured put and a flush. Returns the open store and the
    seconds of (first put, measured put, measured put -> flushed)."""
    from kvstore import PrefixStore

    store = PrefixStore(budget_gb=budget_gb, ssd_path=path, block_size=BLOCK, kv_bits=kv_bits)
    t0 = time.perf_counter()
    store.put(KEY, warm_tokens, warm)
    first = time.perf_counter() - t0
    store.flush()
    gc.collect()
    t0 = time.perf_counter()
    store.put(KEY, toks, layers)
    t1 = time.perf_counter()
    store.flush()
    return store, first, t1 - t0, time.perf_counter() - t0


def run(cfg: dict, R: int, tmp: Path) -> dict:
    from kvstore.blocks.layers import KVLayer

    c = cfg["put"]
    rng = np.random.default_rng(30)
    n = c["tokens"]
    # one K/V pair shared by every layer: the store slices and copies each layer separately,
    # so bytes moved are those of a full set of distinct layers
    layers = kv_layers(rng, c["layers"], c["heads"], c["dim"], n, distinct=False)
    nbytes = fp16_nbytes(layers)
    budget = max(1.0, 2 * nbytes / GiB)
    res: dict[str, Any] = {"shape": dict(c, block_size=BLOCK), "bytes": nbytes}
    log(f"put: {c['layers']} layers x {c['heads']} heads x {c['dim']} dim x {n} tokens = {nbytes / MiB:.0f} MiB")
    R = min(R, 3)  # each repeat moves the whole cache through the background thread and LMDB
    blocking, blocking_ram, total, dedup, first, ws = [], [], [], [], [], []
    warm = [KVLayer(l.keys[..., :BLOCK, :], l.values[..., :BLOCK, :]) for l in layers]
    plain = tmp / "plain-write"
    random_chunk(min(WRITE_CHUNK, nbytes))  # the bytes to write, made before the clock starts
    for r in range(R):
        # baseline in the same repeat (this box is shared: conditions drift between repeats):
        # write + fsync a plain file of the same size
        ws.append(timed_write(plain, nbytes))
        toks = rand_tokens(rng, n, 100_000)
        path = tmp / f"put-{r}"
        store, t_first, t_put, t_total = _measured_put(path, budget, rand_tokens(rng, BLOCK, 100_000), warm,
                                                       toks, layers)
        first.append(t_first)
        blocking.append(t_put)
        total.append(t_total)
        assert store.stats()["blocks_written"] == (n + BLOCK - 1) // BLOCK + 1
        t0 = time.perf_counter()
        store.put(KEY, toks, layers)  # already stored: hash + walk only
        dedup.append(time.perf_counter() - t0)
        ssd_bytes = store.stats()["ssd_bytes"]
        store.close()
        shutil.rmtree(path)
        # and after it: the faster of the two counts (on this VM a write whose page cache is memory the host took
        # back runs at ~0.4 GB/s, whichever of the two it is)
        ws[-1] = min(ws[-1], timed_write(plain, nbytes))
        s2, _, t_put, _ = _measured_put(None, budget, rand_tokens(rng, BLOCK, 100_000), warm, toks, layers)
        blocking_ram.append(t_put)
        s2.close()
        del store, s2
    res["blocking_ssd_store"] = stat(blocking)
    res["blocking_ram_store"] = stat(blocking_ram)
    res["blocking_already_stored"] = stat(dedup)
    res["blocking_first_put_of_model"] = stat(first)
    res["background_to_ssd"] = stat(total, nbytes)  # put -> flushed: encode + LMDB commit (fsync'd)
    res["flushed_gbps"] = res["background_to_ssd"]["gbps"]
    res["ssd_bytes"] = ssd_bytes
    res["plain_write_fsync"] = stat(ws, nbytes)
    res["ratio_background_vs_plain_write"] = res["background_to_ssd"]["gbps"] / res["plain_write_fsync"]["gbps"]
    res["ratio_per_repeat"] = [round(w / t, 3) for w, t in zip(ws, total)]
    log(f"put: put -> flushed {res['flushed_gbps']:.2f} GB/s, plain write+fsync {res['plain_write_fsync']['gbps']:.2f} "
        f"GB/s (medians of {R}); ratio {res['ratio_background_vs_plain_write']:.2f}x, per repeat "
        f"{res['ratio_per_repeat']}")
    # 8-bit entries (quantizing runs on the background thread too), on a smaller cache
    nq = c["q8_tokens"]
    lq = kv_layers(rng, c["layers"], c["heads"], c["dim"], nq, distinct=False)
    qb, qt = [], []
    for r in range(R):
        toks = rand_tokens(rng, nq, 100_000)
        path = tmp / f"putq-{r}"
        store, _, t_put, t_total = _measured_put(path, budget, rand_tokens(rng, BLOCK, 100_000), warm, toks, lq,
                                                 kv_bits=8)
        qb.append(t_put)
        qt.append(t_total)
        store.close()
        shutil.rmtree(path)
    res["q8"] = {"tokens": nq, "fp16_bytes": fp16_nbytes(lq), "blocking": stat(qb),
                 "background_to_ssd": stat(qt, fp16_nbytes(lq))}
    res["target_ms"] = TARGETS["put_block_ms"]
    res["met"] = res["blocking_ssd_store"]["median_s"] * 1e3 < TARGETS["put_block_ms"]
    return res
