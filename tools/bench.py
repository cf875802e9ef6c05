#!/usr/bin/env python
"""kvstore benchmarks: restore, lookup, put, ttft, replay, fidelity.

    python tools/bench.py [--quick | --smoke] [--only PART ...] [--out DIR]
                          [--repeats N] [--tmp DIR] [--write-docs]

Every figure is a median over repeats, and every figure that has a baseline
(memcpy, a plain file read, a cold prefill, mlx-lm's ``LRUPromptCache``) has it
measured in the same run, so the ratios are what to read: absolute numbers
depend on the machine (mlx on a Linux CPU is far slower than on Apple silicon).

Writes ``DIR/<part>.json``, ``DIR/results.json`` and ``DIR/*.png`` (default
``bench-out/``); a full run (or ``--write-docs``) also writes
``docs/benchmarks.md`` and copies the plots to ``docs/bench/``.

Parts:

restore   fetch GB/s from the RAM tier and the SSD tier (page-cached and cold)
          for fp16 / 8-bit / 4-bit entries of a Llama-3-8B-shaped layer set,
          vs memcpy and vs a plain read of a file of the same size; quantized
          hand-over vs dequantize, and faster dequantize paths.
lookup    index walk + key hashing of a 128K-token prompt against 1M blocks.
put       how long ``put`` blocks the caller for a 32K-token cache, and the
          background throughput to SSD.
ttft      time to first token on the tiny llama: cold prefill vs kvstore RAM /
          SSD hit vs mlx-lm ``LRUPromptCache`` hit.
replay    a seeded multi-user chat / agent trace under one RAM byte budget:
          LRUPromptCache vs kvstore fp16 vs q8 vs q8 + SSD (real model runs).
fidelity  logit error, KL and top-1 / greedy agreement of quantized entries on
          the tiny llama, gemma3_text and qwen3_next models.

Importable: ``main(argv=None)`` returns 0 (the ``kvstore bench`` command calls it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

PARTS = ("restore", "lookup", "put", "ttft", "replay", "fidelity")
GiB = 1 << 30
MiB = 1 << 20

# ----------------------------------------------------------------------- sizes

SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        repeats=2,
        restore=dict(layers=2, heads=2, dim=64, tokens=512),
        lookup=dict(tokens=16384, filler=20_000, repeats=20),
        put=dict(layers=2, heads=2, dim=64, tokens=4096, q8_tokens=1024),
        ttft=dict(lengths=[256], hit_repeats=2),
        replay=dict(sys_lens=[256, 192], sys_p=[0.6, 0.4], sessions=3, concurrency=2, chat_turns=(2, 3),
                    user=(8, 32), resp=(8, 16), agent_turns=(2, 3), tool=(16, 48), action=(4, 8),
                    agent_frac=0.34, budget_fracs=[0.25]),
        fidelity=dict(kinds=["llama"], codecs=[None, 8], prompts=1, prompt_len=300, prefix=256, gen=4),
    ),
    "quick": dict(
        repeats=3,
        restore=dict(layers=8, heads=8, dim=128, tokens=2048),
        lookup=dict(tokens=131072, filler=200_000, repeats=50),
        put=dict(layers=4, heads=8, dim=128, tokens=32768, q8_tokens=4096),
        ttft=dict(lengths=[1024, 4096], hit_repeats=5),
        replay=dict(sys_lens=[768, 512, 384], sys_p=[0.5, 0.3, 0.2], sessions=12, concurrency=4, chat_turns=(2, 5),
                    user=(24, 96), resp=(16, 64), agent_turns=(3, 6), tool=(48, 192), action=(8, 32),
                    agent_frac=0.4, budget_fracs=[0.25, 0.1]),
        fidelity=dict(kinds=["llama", "gemma3_text", "qwen3_next"], codecs=[None, 8, 6, 4, (8, 4)], prompts=2,
                      prompt_len=600, prefix=512, gen=8),
    ),
    "full": dict(
        repeats=5,
        restore=dict(layers=32, heads=8, dim=128, tokens=2048),
        lookup=dict(tokens=131072, filler=1_000_000, repeats=100),
        put=dict(layers=32, heads=8, dim=128, tokens=32768, q8_tokens=4096),
        ttft=dict(lengths=[1024, 4096, 16384], hit_repeats=5),
        replay=dict(sys_lens=[1536, 1024, 768], sys_p=[0.5, 0.3, 0.2], sessions=24, concurrency=6, chat_turns=(3, 7),
                    user=(32, 160), resp=(24, 128), agent_turns=(4, 9), tool=(64, 384), action=(16, 48),
                    agent_frac=0.4, budget_fracs=[0.25, 0.1]),
        fidelity=dict(kinds=["llama", "gemma3_text", "qwen3_next"], codecs=[None, 8, 6, 4, (8, 4)], prompts=6,
                      prompt_len=600, prefix=512, gen=16),
    ),
}

TARGETS = {
    "restore_ram_vs_memcpy": 0.5,
    "restore_ssd_warm_vs_read": 0.4,
    "restore_ssd_cold_vs_read": 0.7,
    "lookup_ms": 1.0,
    "put_block_ms": 1.0,
    "replay_recompute_vs_lru": 1 / 3,
}

# ---------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(ts) -> float:
    return float(np.median(ts)) if len(ts) else float("nan")


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 0,
          setup: Optional[Callable[[], Any]] = None, teardown: Optional[Callable[[Any], None]] = None) -> list[float]:
    """Wall times of ``fn`` (results dropped after each call, outside the timing)."""
    ts = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        if teardown is not None:
            teardown(r)
        del r
        if i >= warmup:
            ts.append(dt)
    return ts


def stat(ts: list[float], nbytes: Optional[int] = None) -> dict:
    out = {"median_s": med(ts), "times_s": [round(t, 6) for t in ts]}
    if nbytes is not None:
        out["gbps"] = nbytes / out["median_s"] / 1e9 if out["median_s"] > 0 else float("inf")
    return out


def drop_page_cache(path: Path) -> None:
    """Evict a file's pages from the page cache (it must not be mapped)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float:
    """Fraction of a file's pages in the page cache (mincore on a fresh read-only map)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        view = np.frombuffer(m, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
        if rc != 0:
            return float("nan")
        return sum(v & 1 for v in vec) / n
    finally:
        m.close()


def rand_tokens(rng: np.random.Generator, n: int, hi: int = 1000) -> np.ndarray:
    return rng.integers(5, hi, n).astype(np.int32)


def kv_layers(rng: np.random.Generator, layers: int, heads: int, dim: int, tokens: int, distinct: bool = True):
    """``layers`` KVLayers of fp16 normal noise (``distinct=False`` shares one K/V pair)."""
    from kvstore.layers import KVLayer

    def one():
        a = rng.standard_normal((1, heads, tokens, dim), dtype=np.float32).astype(np.float16)
        x = mx.array(a)
        mx.eval(x)
        return x

    if not distinct:
        k, v = one(), one()
        return [KVLayer(k, v) for _ in range(layers)]
    return [KVLayer(one(), one()) for _ in range(layers)]


def fp16_nbytes(layers) -> int:
    return sum(l.nbytes for l in layers)


@contextlib.contextmanager
def lmdb_readahead(enabled: bool):
    """Open LMDB environments with ``readahead=enabled`` (bench-only experiment:
    kvstore/tiers/lmdb.py opens with readahead=False)."""
    import lmdb

    orig = lmdb.open

    def patched(*a, **kw):
        kw["readahead"] = enabled
        return orig(*a, **kw)

    lmdb.open = patched
    try:
        yield
    finally:
        lmdb.open = orig


def _lmdb_readahead_flag(tmp: Path) -> Optional[bool]:
    """Whether kvstore's LMDB tier opens its environment with readahead."""
    from kvstore.tiers.lmdb import LmdbTier

    t = LmdbTier(tmp / "flag-probe", 64 << 20)
    try:
        return bool(t.env.flags().get("readahead"))
    finally:
        t.close()
        shutil.rmtree(tmp / "flag-probe", ignore_errors=True)


def _read_ahead_kb(path: Path) -> Optional[int]:
    """The block device's read_ahead_kb under ``path`` (Linux), if found."""
    try:
        dev = os.stat(path).st_dev
        sysdir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        for q in (sysdir / "queue", sysdir.resolve().parent / "queue"):
            f = q / "read_ahead_kb"
            if f.exists():
                return int(f.read_text())
    except (OSError, ValueError):
        pass
    return None


def plain_read(path: Path, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(buf)
        got = 0
        while got < nbytes:
            n = f.readinto(mv[got:])
            if not n:
                break
            got += n
    return buf


def write_file(path: Path, nbytes: int, chunk: int = 64 * MiB) -> None:
    rng = np.random.default_rng(1)
    block = rng.integers(0, 256, min(chunk, nbytes), dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def memcpy_baselines(nbytes: int, repeats: int) -> dict:
    """numpy copy (alloc + memcpy) and numpy -> mx.array copy of ``nbytes``."""
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    np_t = timed(lambda: src.copy(), repeats, warmup=1)

    def to_mx():
        a = mx.array(src.view(np.float16))
        mx.eval(a)
        return a

    mx_t = timed(to_mx, repeats, warmup=1)
    return {"numpy_copy": stat(np_t, nbytes), "mx_array_copy": stat(mx_t, nbytes)}


# ====================================================================== restore


def _np_dequant(q, threads: int = 1):
    """Vectorized numpy dequantize of a Quantized (bits 8 or 4, f32 math)."""
    bits, gs = q.bits, q.group_size
    data = np.asarray(q.data).view(np.uint8)
    if bits == 8:
        u = data
    else:
        u = np.empty(data.shape[:-1] + (data.shape[-1] * 2,), np.uint8)
        np.bitwise_and(data, 0xF, out=u[..., 0::2])
        np.right_shift(data, 4, out=u[..., 1::2])
    s = np.asarray(q.scales).astype(np.float32)[..., None]
    b = np.asarray(q.biases).astype(np.float32)[..., None]
    g = u.reshape(*u.shape[:-1], -1, gs).astype(np.float32)
    g *= s
    g += b
    return g.astype(np.float16).reshape(*u.shape[:-1], -1)


def _dequant_paths(hit_q, R: int, nbytes_out: int) -> dict:
    """Time the ways to turn the fetched Quantized tensors into fp16 mx arrays."""
    from kvstore.layers import Quantized

    qs = [t for l in hit_q.layers for t in (l.keys, l.values) if isinstance(t, Quantized)]
    if not qs or qs[0].bits not in (8, 4):
        return {}
    ref = [mx.dequantize(q.data, q.scales, q.biases, group_size=q.group_size, bits=q.bits) for q in qs]
    mx.eval(ref)

    def shipped():
        out = [q.dequantize() for q in qs]
        mx.eval(out)
        return out

    def spread_cores():
        from kvstore.spread import spread

        return spread([q.dequantize for q in qs])

    def mx_kernel():
        out = [mx.dequantize(q.data, q.scales, q.biases, group_size=q.group_size, bits=q.bits) for q in qs]
        mx.eval(out)
        return out

    def mx_f32():
        out = [mx.dequantize(q.data, q.scales.astype(mx.float32), q.biases.astype(mx.float32),
                             group_size=q.group_size, bits=q.bits).astype(mx.float16) for q in qs]
        mx.eval(out)
        return out

    def np_1():
        out = [mx.array(_np_dequant(q)) for q in qs]
        mx.eval(out)
        return out

    pool = ThreadPoolExecutor(2)

    def np_2():
        out = list(pool.map(lambda q: mx.array(_np_dequant(q)), qs))
        mx.eval(out)
        return out

    res = {}
    for name, fn in (("kvstore Quantized.dequantize, one core", shipped),
                     ("the same on every core (kvstore.spread, as fetch runs it)", spread_cores),
                     ("mx.dequantize (mlx CPU kernel)", mx_kernel),
                     ("mx.dequantize, f32 scales -> fp16", mx_f32),
                     ("numpy f32 -> mx.array", np_1), ("numpy f32 x2 threads -> mx.array", np_2)):
        out = fn()
        err = max(float(mx.max(mx.abs(a.astype(mx.float32) - r.astype(mx.float32))).item()) for a, r in zip(out, ref))
        del out
        res[name] = dict(stat(timed(fn, R, warmup=0), nbytes_out), max_abs_diff_vs_mx_dequantize=err)
    pool.shutdown()
    base = res["kvstore Quantized.dequantize, one core"]["median_s"]
    for v in res.values():
        v["speedup_vs_shipped"] = base / v["median_s"]
    return res


def _ssd_numpy_assemble(store, key: str, toks: np.ndarray) -> list:
    """Prototype of a faster SSD fetch (dense entries, full blocks only): read
    every block's payload view in one LMDB transaction, check it, concatenate
    each layer's rows with numpy straight from the mmap views (one memcpy that
    numpy backs with huge pages), then one ``mx.array`` copy per tensor —
    instead of ``mx.array`` per block and ``mx.concatenate`` per layer."""
    import xxhash

    from kvstore.codec import _DTYPES, read_header
    from kvstore.hashing import KeyChain, root_key

    bs = store.block_size
    chain = KeyChain(root_key(key, store.namespace), toks, bs)
    disk = store._disk
    with disk.reader() as txn:
        views = []
        for i in range(len(toks) // bs):
            buf = memoryview(disk.get_block(txn, chain.key(i)))
            h = read_header(buf)
            pl = buf[h.payload_start:]
            if xxhash.xxh3_64_intdigest(pl) != h.fields["sum"]:
                raise ValueError("checksum")
            t = h.fields["tok"]
            if not np.array_equal(np.frombuffer(pl, "<i4", count=h.ntokens, offset=t[2]), toks[i * bs:(i + 1) * bs]):
                raise ValueError("tokens")
            views.append((h, pl))
        out = []
        for li in range(len(views[0][0].layers)):
            kv = []
            for which in ("k", "v"):
                parts = []
                for h, pl in views:
                    name, shape, off, n = h.layers[li][which]["a"]
                    dt = _DTYPES[name][1]
                    parts.append(np.frombuffer(pl, dtype=dt, count=n // dt.itemsize, offset=off).reshape(shape))
                kv.append(mx.array(np.concatenate(parts, axis=-2)))
            out.append(kv)
        mx.eval(out)
    return out


def bench_restore(cfg: dict, R: int, tmp: Path) -> dict:
    from kvstore import PrefixStore

    c = cfg["restore"]
    rng = np.random.default_rng(10)
    layers = kv_layers(rng, c["layers"], c["heads"], c["dim"], c["tokens"])
    toks = rand_tokens(rng, c["tokens"], 100_000)
    out_bytes = fp16_nbytes(layers)
    key = "bench-restore"
    res: dict[str, Any] = {"shape": dict(c, block_size=256, dtype="float16"), "fp16_bytes": out_bytes, "entries": {},
                           "lmdb_readahead": _lmdb_readahead_flag(tmp), "read_ahead_kb": _read_ahead_kb(tmp)}
    log(f"restore: {c['layers']} layers x {c['heads']} heads x {c['dim']} dim x {c['tokens']} tokens "
        f"= {out_bytes / MiB:.0f} MiB fp16")
    baselines: dict[int, dict] = {}

    def baseline(nbytes: int) -> dict:
        if nbytes not in baselines:
            b = memcpy_baselines(nbytes, R)
            f = tmp / f"plain-{nbytes}"
            write_file(f, nbytes)
            b["read_page_cached"] = stat(timed(lambda: plain_read(f, nbytes), R, warmup=1), nbytes)
            b["read_cold"] = stat(timed(lambda: plain_read(f, nbytes), R, setup=lambda: drop_page_cache(f)), nbytes)
            f.unlink()
            baselines[nbytes] = b
        return baselines[nbytes]

    for bits in (None, 8, 4):
        name = "fp16" if bits is None else f"q{bits}"
        log(f"restore: {name}")
        e: dict[str, Any] = {}
        Rs = R if bits is None else min(R, 3)  # dequantizing fetches take seconds on a CPU
        # --- RAM tier
        store = PrefixStore(budget_gb=64, block_size=256, kv_bits=bits)
        store.put(key, toks, layers)
        store.flush()
        stored = store.nbytes
        e["stored_bytes"] = stored
        hit = store.fetch(key, toks)
        assert hit.length == len(toks) and hit.ram_tokens == len(toks), hit
        del hit
        e["ram"] = stat(timed(lambda: store.fetch(key, toks), Rs, warmup=1), stored)
        e["ram"]["out_gbps"] = out_bytes / e["ram"]["median_s"] / 1e9
        if bits is not None:
            e["ram_quantized"] = stat(timed(lambda: store.fetch(key, toks, quantized=(bits, 64)), R, warmup=1), stored)
            hq = store.fetch(key, toks, quantized=(bits, 64))
            e["dequant_share_of_ram_fetch"] = 1 - e["ram_quantized"]["median_s"] / e["ram"]["median_s"]
            e["dequant_paths"] = _dequant_paths(hq, Rs, out_bytes)
            del hq
        store.close()
        del store
        gc.collect()
        # --- SSD tier
        path = tmp / f"ssd-{name}"
        store = PrefixStore(budget_gb=64, ssd_path=path, block_size=256, kv_bits=bits)
        store.put(key, toks, layers)
        store.flush()
        store.close()
        data = path / "data.mdb"
        # budget 0: nothing is promoted to RAM, every fetch reads LMDB
        store = PrefixStore(budget_gb=0, ssd_path=path)
        hit = store.fetch(key, toks)
        assert hit.length == len(toks) and hit.ssd_tokens == len(toks), (hit.length, hit.ssd_tokens)
        del hit
        e["ssd_page_cached"] = stat(timed(lambda: store.fetch(key, toks), Rs, warmup=1), stored)
        if bits is None:
            ref = store.fetch(key, toks)
            proto = _ssd_numpy_assemble(store, key, toks)
            assert all(bool(mx.array_equal(l.keys, k).item()) and bool(mx.array_equal(l.values, v).item())
                       for l, (k, v) in zip(ref.layers, proto))
            del ref, proto
            e["ssd_page_cached_numpy_assemble"] = stat(
                timed(lambda: _ssd_numpy_assemble(store, key, toks), Rs, warmup=1), stored)
        if bits is not None:
            e["ssd_page_cached_quantized"] = stat(
                timed(lambda: store.fetch(key, toks, quantized=(bits, 64)), R, warmup=1), stored)
        store.close()

        def cold_fetch(readahead: Optional[bool] = None, quantized=None, reps: int = R) -> dict:
            ts, pre = [], []
            for _ in range(reps):
                drop_page_cache(data)
                ctx = lmdb_readahead(readahead) if readahead is not None else contextlib.nullcontext()
                with ctx:
                    s = PrefixStore(budget_gb=0, ssd_path=path)
                pre.append(resident_fraction(data))  # opening reads the index: some pages come in
                t0 = time.perf_counter()
                h = s.fetch(key, toks, quantized=quantized)
                ts.append(time.perf_counter() - t0)
                assert h.ssd_tokens == len(toks)
                del h
                s.close()
            return dict(stat(ts, stored), resident_before_fetch=pre)

        q = None if bits is None else (bits, 64)
        e["ssd_cold"] = cold_fetch(reps=Rs)  # kvstore as it is
        if bits is not None:  # the I/O path without the dequantize
            e["ssd_cold_quantized"] = cold_fetch(quantized=q)
        # LMDB readahead forced off / on (the I/O path: Quantized for quantized entries)
        e["ssd_cold_ra_off"] = cold_fetch(False, quantized=q)
        e["ssd_cold_ra_on"] = cold_fetch(True, quantized=q)
        e["lmdb_file_bytes"] = data.stat().st_size
        shutil.rmtree(path)
        # --- ratios against the same bytes
        b = baseline(stored)
        e["baselines"] = b
        e["ratio"] = {
            "ram_vs_numpy_memcpy": e["ram"]["gbps"] / b["numpy_copy"]["gbps"],
            "ram_vs_mx_array_copy": e["ram"]["gbps"] / b["mx_array_copy"]["gbps"],
            "ssd_page_cached_vs_read": e["ssd_page_cached"]["gbps"] / b["read_page_cached"]["gbps"],
            "ssd_page_cached_numpy_assemble_vs_read": (e["ssd_page_cached_numpy_assemble"]["gbps"]
                                                       / b["read_page_cached"]["gbps"]
                                                       if "ssd_page_cached_numpy_assemble" in e else None),
            "ssd_cold_vs_read_cold": e["ssd_cold"]["gbps"] / b["read_cold"]["gbps"],
            "ssd_cold_ra_off_vs_read_cold": e["ssd_cold_ra_off"]["gbps"] / b["read_cold"]["gbps"],
            "ssd_cold_ra_on_vs_read_cold": e["ssd_cold_ra_on"]["gbps"] / b["read_cold"]["gbps"],
        }
        if bits is not None:
            e["ratio"]["ssd_cold_quantized_vs_read_cold"] = e["ssd_cold_quantized"]["gbps"] / b["read_cold"]["gbps"]

        if bits is not None:
            e["ratio"]["ram_quantized_vs_numpy_memcpy"] = e["ram_quantized"]["gbps"] / b["numpy_copy"]["gbps"]
            e["ratio"]["ram_quantized_vs_mx_array_copy"] = e["ram_quantized"]["gbps"] / b["mx_array_copy"]["gbps"]
            e["ratio"]["ssd_page_cached_quantized_vs_read"] = (
                e["ssd_page_cached_quantized"]["gbps"] / b["read_page_cached"]["gbps"])
            e["ratio"]["dequantized_vs_quantized_time"] = e["ram"]["median_s"] / e["ram_quantized"]["median_s"]
        res["entries"][name] = e
        gc.collect()
    return res


def plot_restore(res: dict, out: Path) -> list[str]:
    plt = _plt()
    names = list(res["entries"])
    series = [("RAM", "ram"), ("RAM, Quantized", "ram_quantized"), ("SSD page-cached", "ssd_page_cached"),
              ("SSD cold", "ssd_cold"), ("SSD cold, I/O path, LMDB readahead off", "ssd_cold_ra_off"),
              ("SSD cold, I/O path, LMDB readahead on", "ssd_cold_ra_on")]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=80)
    w = 0.8 / (len(series) + 3)
    x = np.arange(len(names))
    i = 0
    for label, k in series:
        vals = [res["entries"][n].get(k, {}).get("gbps", 0) for n in names]
        ax.bar(x + i * w, vals, w, label=label)
        i += 1
    for label, k in (("numpy memcpy", "numpy_copy"), ("mx.array copy", "mx_array_copy"),
                     ("plain read, cached", "read_page_cached")):
        vals = [res["entries"][n]["baselines"][k]["gbps"] for n in names]
        ax.bar(x + i * w, vals, w, label=label, hatch="//", alpha=0.6)
        i += 1
    ax.set_xticks(x + w * (i - 1) / 2)
    ax.set_xticklabels(names)
    ax.set_ylabel("GB/s of stored bytes")
    ax.set_title("fetch throughput (median)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = out / "restore.png"
    fig.savefig(p)
    plt.close(fig)
    return [p.name]


# ======================================================================= lookup


def bench_lookup(cfg: dict, R: int) -> dict:
    from kvstore import PrefixStore
    from kvstore.hashing import KeyChain, as_tokens, root_key

    c = cfg["lookup"]
    reps = c["repeats"]
    n, filler = c["tokens"], c["filler"]
    bs = 256
    rng = np.random.default_rng(20)
    key = "bench-lookup"
    store = PrefixStore(budget_gb=8, block_size=bs)
    toks = rand_tokens(rng, n, 100_000)
    toks_list = toks.tolist()
    # the measured prompt's blocks: real KV (the tiny llama's shape: 2 layers, 1 head, dim 64)
    layers = kv_layers(rng, 2, 1, 64, n)
    store.put(key, toks, layers)
    store.flush()
    del layers
    # filler blocks: index nodes straight into the radix index, chains of 512 under the same root
    t0 = time.perf_counter()
    root = store._root(key)
    keys = np.frombuffer(os.urandom(16 * filler), dtype="S16")
    firsts = rng.integers(5, 100_000, filler)
    chain = 512
    node = root
    for i in range(filler):
        if i % chain == 0:
            node = root
        node = store._index.add(node, keys[i].tobytes(), node.end, bs, int(firsts[i]))
    build_s = time.perf_counter() - t0
    log(f"lookup: index holds {len(store._index):,} blocks (filler built in {build_s:.1f} s)")
    res: dict[str, Any] = {"prompt_tokens": n, "block_size": bs, "blocks_indexed": len(store._index),
                           "prompt_blocks": n // bs, "filler_build_s": build_s}
    rk = root_key(key)

    def hash_np():
        ch = KeyChain(rk, as_tokens(toks), bs)
        return [ch.key(i) for i in range(n // bs)]

    def hash_list():
        ch = KeyChain(rk, as_tokens(toks_list), bs)
        return [ch.key(i) for i in range(n // bs)]

    pkeys = hash_np()

    def walk():
        return store._index.match(root, pkeys)

    assert walk().length == n
    assert store.contains(key, toks) == n
    other = toks.copy()
    other[n - 100] += 1  # diverges inside the last block: a partial hit
    assert store.contains(key, other) == n - 100
    ext = np.concatenate([toks, rand_tokens(rng, 700, 100_000)])  # the next turn: stored prefix + new tokens
    res["hash_only_np"] = stat(timed(hash_np, reps, warmup=2))
    res["hash_only_list"] = stat(timed(hash_list, reps, warmup=2))
    res["as_tokens_list"] = stat(timed(lambda: as_tokens(toks_list), reps, warmup=2))
    res["walk_only"] = stat(timed(walk, reps, warmup=2))
    res["contains_np"] = stat(timed(lambda: store.contains(key, toks), reps, warmup=2))
    res["contains_list"] = stat(timed(lambda: store.contains(key, toks_list), reps, warmup=2))
    res["contains_partial_np"] = stat(timed(lambda: store.contains(key, other), reps, warmup=2))
    res["contains_next_turn_np"] = stat(timed(lambda: store.contains(key, ext), reps, warmup=2))
    miss = rand_tokens(rng, n, 100_000)
    res["contains_miss_np"] = stat(timed(lambda: store.contains(key, miss), reps, warmup=2))
    kv_bytes = store.nbytes
    res["fetch_full"] = stat(timed(lambda: store.fetch(key, toks), max(3, R), warmup=1), kv_bytes)
    res["fetch_full"]["kv_bytes"] = kv_bytes
    res["target_ms"] = TARGETS["lookup_ms"]
    res["met"] = res["contains_np"]["median_s"] * 1e3 < TARGETS["lookup_ms"]
    res["met_list_input"] = res["contains_list"]["median_s"] * 1e3 < TARGETS["lookup_ms"]
    store.close()
    return res


# ========================================================================== put


def bench_put(cfg: dict, R: int, tmp: Path) -> dict:
    from kvstore import PrefixStore

    c = cfg["put"]
    rng = np.random.default_rng(30)
    n = c["tokens"]
    # one K/V pair shared by every layer: the store slices and copies each layer separately,
    # so bytes moved are those of a full set of distinct layers
    layers = kv_layers(rng, c["layers"], c["heads"], c["dim"], n, distinct=False)
    nbytes = fp16_nbytes(layers)
    res: dict[str, Any] = {"shape": dict(c, block_size=256), "bytes": nbytes}
    log(f"put: {c['layers']} layers x {c['heads']} heads x {c['dim']} dim x {n} tokens = {nbytes / MiB:.0f} MiB")
    R = min(R, 3)  # each repeat moves the whole cache through the background thread and LMDB
    blocking, blocking_ram, total, dedup, first = [], [], [], [], []
    key = "bench-put"
    from kvstore.layers import KVLayer

    warm = [KVLayer(l.keys[..., :256, :], l.values[..., :256, :]) for l in layers]
    for r in range(R):
        toks = rand_tokens(rng, n, 100_000)
        path = tmp / f"put-{r}"
        store = PrefixStore(budget_gb=max(1.0, 2 * nbytes / GiB), ssd_path=path, block_size=256)
        # the first put of a model key registers it in LMDB (a write transaction on the
        # caller's thread): timed apart, on another short prompt, before the measured put
        t0 = time.perf_counter()
        store.put(key, rand_tokens(rng, 256, 100_000), warm)
        first.append(time.perf_counter() - t0)
        store.flush()
        gc.collect()
        t0 = time.perf_counter()
        store.put(key, toks, layers)
        t1 = time.perf_counter()
        store.flush()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        total.append(t2 - t0)
        assert store.stats()["blocks_written"] == (n + 255) // 256 + 1
        t0 = time.perf_counter()
        store.put(key, toks, layers)  # already stored: hash + walk only
        dedup.append(time.perf_counter() - t0)
        ssd_bytes = store.stats()["ssd_bytes"]
        store.close()
        shutil.rmtree(path)
        s2 = PrefixStore(budget_gb=max(1.0, 2 * nbytes / GiB), block_size=256)
        s2.put(key, rand_tokens(rng, 256, 100_000), warm)
        s2.flush()
        t0 = time.perf_counter()
        s2.put(key, toks, layers)
        blocking_ram.append(time.perf_counter() - t0)
        s2.close()
        del store, s2
    res["blocking_ssd_store"] = stat(blocking)
    res["blocking_ram_store"] = stat(blocking_ram)
    res["blocking_already_stored"] = stat(dedup)
    res["blocking_first_put_of_model"] = stat(first)
    res["background_to_ssd"] = stat(total, nbytes)
    res["ssd_bytes"] = ssd_bytes
    # baseline: write + fsync a plain file of the same size
    f = tmp / "plain-write"
    ws = []
    for _ in range(R):
        t0 = time.perf_counter()
        write_file(f, nbytes)
        ws.append(time.perf_counter() - t0)
        f.unlink()
    res["plain_write_fsync"] = stat(ws, nbytes)
    res["ratio_background_vs_plain_write"] = res["background_to_ssd"]["gbps"] / res["plain_write_fsync"]["gbps"]
    # 8-bit entries (quantizing runs on the background thread too), on a smaller cache
    nq = c["q8_tokens"]
    lq = kv_layers(rng, c["layers"], c["heads"], c["dim"], nq, distinct=False)
    qb, qt = [], []
    for r in range(R):
        toks = rand_tokens(rng, nq, 100_000)
        path = tmp / f"putq-{r}"
        store = PrefixStore(budget_gb=max(1.0, 2 * nbytes / GiB), ssd_path=path, block_size=256, kv_bits=8)
        store.put(key, rand_tokens(rng, 256, 100_000), warm)
        store.flush()
        t0 = time.perf_counter()
        store.put(key, toks, lq)
        t1 = time.perf_counter()
        store.flush()
        t2 = time.perf_counter()
        qb.append(t1 - t0)
        qt.append(t2 - t0)
        store.close()
        shutil.rmtree(path)
    res["q8"] = {"tokens": nq, "fp16_bytes": fp16_nbytes(lq), "blocking": stat(qb),
                 "background_to_ssd": stat(qt, fp16_nbytes(lq))}
    res["target_ms"] = TARGETS["put_block_ms"]
    res["met"] = res["blocking_ssd_store"]["median_s"] * 1e3 < TARGETS["put_block_ms"]
    return res


# ======================================================================== model


_MODELS: dict[str, tuple] = {}


def load_tiny(kind: str):
    """(model, tokenizer, path) of a tiny fixed-seed model, built once."""
    if kind not in _MODELS:
        import mlx_lm

        from kvstore.adapters.tiny_models import ensure_tiny_model

        path = ensure_tiny_model(kind)  # max_position_embeddings 32768: enough for the 16K ttft prompts
        model, tok = mlx_lm.load(str(path))
        _MODELS[kind] = (model, tok, path)
    return _MODELS[kind]


def run_tokens(model, cache, toks, step: int = 2048, logits: bool = True):
    """Feed ``toks`` into ``cache``; logits of the last position (float32).

    As mlx-lm's prefill: chunks before the last token only evaluate the cache
    (the lm head never runs on them), the last token gives the logits."""
    toks = np.asarray(toks, dtype=np.int32)
    body = toks[:-1] if logits else toks
    for i in range(0, len(body), step):
        model(mx.array(body[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    if not logits:
        return None
    out = model(mx.array(toks[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
    mx.eval(out)
    return out


# ========================================================================= ttft


def bench_ttft(cfg: dict, R: int, tmp: Path) -> dict:
    import mlx_lm
    from mlx_lm.models import cache as C

    from kvstore.adapters.generate import generate, model_key, store_cache
    from kvstore import PrefixStore

    c = cfg["ttft"]
    model, tok, path = load_tiny("llama")
    mkey = model_key(model, path)
    rng = np.random.default_rng(40)
    res: dict[str, Any] = {"model": "tiny llama (2 layers, 1 KV head, head_dim 64, fp16)",
                           "kv_bytes_per_token": 2 * 2 * 1 * 64 * 2, "lengths": {}}
    for n in c["lengths"]:
        prompt = rand_tokens(rng, n).tolist()
        log(f"ttft: {n} tokens")
        # cold: plain mlx-lm, no cache; the last cold run's cache seeds every cache below
        cold, cache = [], None
        for _ in range(R):
            cache = C.make_prompt_cache(model)
            t0 = time.perf_counter()
            first = None
            for resp in mlx_lm.stream_generate(model, tok, prompt, max_tokens=1, prompt_cache=cache):
                first = resp.token
                cold.append(time.perf_counter() - t0)
                break
        mx.eval([cc.state for cc in cache])
        full = prompt + [first]  # what the cache holds after one generated token
        e: dict[str, Any] = {"cold": stat(cold)}
        # kvstore RAM
        store = PrefixStore(budget_gb=4, block_size=256)
        store_cache(store, mkey, full, cache)
        store.flush()
        ram, cached = [], []
        for _ in range(c["hit_repeats"]):
            g = generate(model, tok, prompt, store=store, max_tokens=1)
            ram.append(g.ttft_s)
            cached.append(g.ram_tokens)
            store.flush()
        store.close()
        e["kvstore_ram"] = dict(stat(ram), cached_tokens=cached[-1])
        # kvstore SSD: close + reopen; page-cached, then cold (LMDB file pages dropped)
        spath = tmp / f"ttft-{n}"
        store = PrefixStore(budget_gb=4, ssd_path=spath, block_size=256)
        store_cache(store, mkey, full, cache)
        store.close()
        for label, cold_disk in (("kvstore_ssd", False), ("kvstore_ssd_cold", True)):
            ts, ssd_tok = [], []
            for _ in range(c["hit_repeats"]):
                if cold_disk:
                    drop_page_cache(spath / "data.mdb")
                s = PrefixStore(budget_gb=4, ssd_path=spath, block_size=256)
                g = generate(model, tok, prompt, store=s, max_tokens=1)
                ts.append(g.ttft_s)
                ssd_tok.append(g.ssd_tokens)
                s.close()
            e[label] = dict(stat(ts), cached_tokens=ssd_tok[-1])
        shutil.rmtree(spath)
        # mlx-lm LRUPromptCache
        lru = C.LRUPromptCache(max_size=10)
        lru.insert_cache(mkey, list(full), cache)
        ts = []
        for _ in range(c["hit_repeats"]):
            t0 = time.perf_counter()
            pc, rest = lru.fetch_nearest_cache(mkey, prompt)
            if not rest:  # exact entry: leave one token to compute
                C.trim_prompt_cache(pc, 1)
                rest = prompt[-1:]
            got = n - len(rest)
            for resp in mlx_lm.stream_generate(model, tok, rest, max_tokens=1, prompt_cache=pc):
                ts.append(time.perf_counter() - t0)
                break
            del pc
        e["lru_prompt_cache"] = dict(stat(ts), cached_tokens=got)
        base = e["cold"]["median_s"]
        e["speedup_vs_cold"] = {k: base / v["median_s"] for k, v in e.items() if k != "cold" and "median_s" in v}
        e["kvstore_ram_vs_lru"] = e["kvstore_ram"]["median_s"] / e["lru_prompt_cache"]["median_s"]
        res["lengths"][str(n)] = e
        del cache
        gc.collect()
    return res


def plot_ttft(res: dict, out: Path) -> list[str]:
    plt = _plt()
    lens = [int(k) for k in res["lengths"]]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    for label, k, m in (("cold prefill", "cold", "o"), ("kvstore RAM hit", "kvstore_ram", "s"),
                        ("kvstore SSD hit (page-cached)", "kvstore_ssd", "^"),
                        ("kvstore SSD hit (cold)", "kvstore_ssd_cold", "v"),
                        ("mlx-lm LRUPromptCache hit", "lru_prompt_cache", "x")):
        ax.plot(lens, [res["lengths"][str(n)][k]["median_s"] * 1e3 for n in lens], marker=m, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title("time to first token, tiny llama (mlx CPU)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = out / "ttft.png"
    fig.savefig(p)
    plt.close(fig)
    return [p.name]


# ======================================================================= replay


def make_trace(c: dict, seed: int = 50) -> dict:
    """Sessions (chats and agent loops) on shared system prompts, interleaved.

    Each request is (session, prompt, response): the prompt is the session's
    system prompt + every earlier turn (new tokens + response) + this turn's new
    tokens (a user message, or a tool output in an agent loop).
    """
    rng = np.random.default_rng(seed)
    systems = [rand_tokens(rng, L) for L in c["sys_lens"]]
    sessions = []
    for s in range(c["sessions"]):
        agent = rng.random() < c["agent_frac"]
        sp = int(rng.choice(len(systems), p=c["sys_p"]))
        if agent:
            turns = int(rng.integers(c["agent_turns"][0], c["agent_turns"][1] + 1))
            segs = [(rand_tokens(rng, int(rng.integers(*c["tool"]))), rand_tokens(rng, int(rng.integers(*c["action"]))))
                    for _ in range(turns)]
        else:
            turns = int(rng.integers(c["chat_turns"][0], c["chat_turns"][1] + 1))
            segs = [(rand_tokens(rng, int(rng.integers(*c["user"]))), rand_tokens(rng, int(rng.integers(*c["resp"]))))
                    for _ in range(turns)]
        sessions.append({"kind": "agent" if agent else "chat", "system": sp, "segs": segs})
    pending = list(range(len(sessions)))
    active = [pending.pop(0) for _ in range(min(c["concurrency"], len(pending)))]
    pos = {s: 0 for s in range(len(sessions))}
    ctx = {s: systems[sessions[s]["system"]] for s in range(len(sessions))}
    requests = []
    while active:
        i = int(rng.integers(len(active)))
        s = active[i]
        new, resp = sessions[s]["segs"][pos[s]]
        prompt = np.concatenate([ctx[s], new])
        requests.append({"session": s, "prompt": prompt, "response": resp})
        ctx[s] = np.concatenate([prompt, resp])
        pos[s] += 1
        if pos[s] == len(sessions[s]["segs"]):
            active.pop(i)
            if pending:
                active.append(pending.pop(0))
    # what a cache of unbounded size could serve: the longest prefix shared with any
    # earlier prompt + response (leaving the last token to compute)
    seen: list[np.ndarray] = []
    ideal = 0
    for r in requests:
        p = r["prompt"]
        best = 0
        for q in seen:
            m = min(len(p), len(q))
            diff = np.flatnonzero(p[:m] != q[:m])
            best = max(best, int(diff[0]) if diff.size else m)
        ideal += min(best, len(p) - 1)
        seen.append(np.concatenate([p, r["response"]]))
    used_sys = {sessions[s]["system"] for s in range(len(sessions))}
    unique = sum(len(systems[k]) for k in used_sys) + sum(len(ctx[s]) - len(systems[sessions[s]["system"]])
                                                         for s in range(len(sessions)))
    return {"requests": requests, "sessions": sessions, "unique_tokens": int(unique),
            "prompt_tokens": int(sum(len(r["prompt"]) for r in requests)), "ideal_cached_tokens": ideal,
            "n_chat": sum(s["kind"] == "chat" for s in sessions), "n_agent": sum(s["kind"] == "agent" for s in sessions)}


def _replay_one(system: str, trace: dict, model, mkey: str, budget: int, tmp: Path) -> dict:
    from mlx_lm.models import cache as C

    from kvstore.adapters.generate import fetch_cache, store_cache
    from kvstore import PrefixStore

    lru, store, spath = None, None, None
    if system == "lru":
        lru = C.LRUPromptCache(max_size=1 << 20, max_bytes=budget)
    else:
        bits = None if system == "kvstore_fp16" else 8
        if system == "kvstore_q8_ssd":
            spath = tmp / "replay-ssd"
        store = PrefixStore(budget_gb=budget / GiB, ssd_path=spath, block_size=256, kv_bits=bits)
    ttft, cached, resident, ram_tok, ssd_tok = [], [], [], 0, 0
    t_start = time.perf_counter()
    for req in trace["requests"]:
        prompt = req["prompt"].tolist()
        n = len(prompt)
        t0 = time.perf_counter()
        if lru is not None:
            cache, rest = lru.fetch_nearest_cache(mkey, prompt)
            if cache is None:
                cache = C.make_prompt_cache(model)
            elif not rest:
                C.trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            got = n - len(rest)
        else:
            r = fetch_cache(store, model, mkey, prompt)
            cache, got = r.cache, r.cached_tokens
            ram_tok += r.ram_tokens
            ssd_tok += r.ssd_tokens
        logits = run_tokens(model, cache, prompt[got:])
        y = mx.argmax(logits)
        mx.eval(y)
        ttft.append(time.perf_counter() - t0)
        cached.append(got)
        # the response (teacher-forced: the trace fixes it), then the cache goes back
        resp = req["response"].tolist()
        run_tokens(model, cache, resp, logits=False)
        full = prompt + resp
        if lru is not None:
            lru.insert_cache(mkey, full, cache)
            resident.append(lru.nbytes)
        else:
            store_cache(store, mkey, full, cache)
            resident.append(store.nbytes)
        del cache
    out: dict[str, Any] = {}
    if store is not None:
        store.flush()
        st = store.stats()
        out["store_stats"] = {k: st.get(k) for k in ("ram_bytes", "ram_blocks", "blocks_indexed", "ssd_bytes",
                                                     "ssd_blocks", "evictions_ram", "sync_writes")}
        out["resident_ram_bytes_end"] = store.nbytes
        store.close()
    else:
        out["resident_ram_bytes_end"] = lru.nbytes
        out["lru_entries_end"] = len(lru)
    if spath is not None:
        shutil.rmtree(spath, ignore_errors=True)
    wall = time.perf_counter() - t_start
    total = trace["prompt_tokens"]
    hit = int(sum(cached))
    out.update({
        "requests": len(ttft), "prompt_tokens": total, "cached_tokens": hit, "recomputed_tokens": total - hit,
        "token_hit_rate": hit / total, "ttft_total_s": float(sum(ttft)), "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p95_s": float(np.percentile(ttft, 95)), "ttft_mean_s": float(np.mean(ttft)),
        "resident_ram_bytes_max": int(max(resident)), "wall_s": wall,
        "ttft_s": [round(t, 5) for t in ttft], "cached_per_request": [int(x) for x in cached],
    })
    if store is not None:
        out["ram_tokens"], out["ssd_tokens"] = ram_tok, ssd_tok
    return out


REPLAY_SYSTEMS = (("lru", "mlx-lm LRUPromptCache"), ("kvstore_fp16", "kvstore RAM fp16"),
                  ("kvstore_q8", "kvstore RAM q8"), ("kvstore_q8_ssd", "kvstore RAM q8 + SSD"))


def bench_replay(cfg: dict, R: int, tmp: Path) -> dict:
    from kvstore.adapters.generate import model_key

    c = cfg["replay"]
    model, tok, path = load_tiny("llama")
    mkey = model_key(model, path)
    trace = make_trace(c)
    bpt = 2 * 2 * 1 * 64 * 2  # fp16 KV bytes per token of the tiny llama
    working = trace["unique_tokens"] * bpt
    total = trace["prompt_tokens"]
    res: dict[str, Any] = {
        "trace": {k: v for k, v in c.items()}, "requests": len(trace["requests"]), "sessions": len(trace["sessions"]),
        "chat_sessions": trace["n_chat"], "agent_sessions": trace["n_agent"], "prompt_tokens": total,
        "unique_tokens": trace["unique_tokens"], "working_set_fp16_bytes": working, "kv_bytes_per_token_fp16": bpt,
        "ideal": {"recomputed_tokens": total - trace["ideal_cached_tokens"],
                  "token_hit_rate": trace["ideal_cached_tokens"] / total},
        "budgets": [],
    }
    run_tokens(model, __import__("mlx_lm").models.cache.make_prompt_cache(model), list(range(5, 300)))  # warm-up
    for frac in c["budget_fracs"]:
        budget = int(frac * working)
        log(f"replay: {len(trace['requests'])} requests, {total:,} prompt tokens, working set "
            f"{working / MiB:.1f} MiB fp16, RAM budget {budget / MiB:.2f} MiB ({frac:.0%})")
        systems: dict[str, Any] = {}
        for name, label in REPLAY_SYSTEMS:
            r = _replay_one(name, trace, model, mkey, budget, tmp)
            r["label"] = label
            systems[name] = r
            log(f"replay: {label}: recomputed {r['recomputed_tokens']:,} tokens, hit rate {r['token_hit_rate']:.1%}, "
                f"TTFT total {r['ttft_total_s']:.1f} s ({r['wall_s']:.0f} s wall)")
            gc.collect()
        base = systems["lru"]
        for r in systems.values():
            r["recompute_vs_lru"] = r["recomputed_tokens"] / max(1, base["recomputed_tokens"])
            r["ttft_total_vs_lru"] = r["ttft_total_s"] / base["ttft_total_s"]
        res["budgets"].append({"budget_frac": frac, "ram_budget_bytes": budget, "systems": systems,
                               "met": systems["kvstore_q8_ssd"]["recompute_vs_lru"] <= TARGETS["replay_recompute_vs_lru"]})
    # the first budget is the headline
    res["ram_budget_bytes"] = res["budgets"][0]["ram_budget_bytes"]
    res["systems"] = res["budgets"][0]["systems"]
    res["target_recompute_vs_lru"] = TARGETS["replay_recompute_vs_lru"]
    res["met"] = res["budgets"][0]["met"]
    return res


def plot_replay(res: dict, out: Path) -> list[str]:
    plt = _plt()
    names = [n for n, _ in REPLAY_SYSTEMS]
    labels = [dict(REPLAY_SYSTEMS)[n].replace("kvstore ", "kvstore\n").replace("mlx-lm ", "mlx-lm\n") for n in names]
    budgets = res["budgets"]
    fig, axs = plt.subplots(1, 3, figsize=(10.5, 3.4), dpi=80)
    x = np.arange(len(names))
    w = 0.8 / len(budgets)
    for i, b in enumerate(budgets):
        lab = f"budget {b['ram_budget_bytes'] / MiB:.1f} MiB ({b['budget_frac']:.0%})"
        axs[0].bar(x + (i - (len(budgets) - 1) / 2) * w, [b["systems"][n]["recomputed_tokens"] / 1e3 for n in names], w,
                   label=lab)
        axs[1].bar(x + (i - (len(budgets) - 1) / 2) * w, [b["systems"][n]["ttft_total_s"] for n in names], w, label=lab)
    axs[0].axhline(res["ideal"]["recomputed_tokens"] / 1e3, color="k", ls="--", lw=1, label="unbounded cache")
    axs[0].set_ylabel("prompt tokens recomputed (K)")
    axs[1].set_ylabel("total TTFT (s)")
    axs[0].legend(fontsize=6)
    axs[1].legend(fontsize=6)
    s0 = budgets[0]["systems"]
    axs[2].bar(x - 0.2, [s0[n]["ttft_p50_s"] * 1e3 for n in names], 0.4, label="p50")
    axs[2].bar(x + 0.2, [s0[n]["ttft_p95_s"] * 1e3 for n in names], 0.4, label="p95")
    axs[2].set_ylabel(f"TTFT (ms), budget {budgets[0]['budget_frac']:.0%}")
    axs[2].legend(fontsize=7)
    for ax in axs:
        ax.set_xticks(x)
        ax.set_xticklabels(labels)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"replay: {res['requests']} requests, {res['prompt_tokens']:,} prompt tokens, working set "
                 f"{res['working_set_fp16_bytes'] / MiB:.1f} MiB fp16 KV (tiny llama, mlx CPU)", fontsize=9)
    fig.tight_layout()
    p = out / "replay.png"
    fig.savefig(p)
    plt.close(fig)
    return [p.name]


# ===================================================================== fidelity


def _codec_name(codec) -> str:
    if codec is None:
        return "fp16"
    if isinstance(codec, tuple):
        return f"K{codec[0]}/V{codec[1]}"
    return f"{codec}-bit"


def _greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    y = int(mx.argmax(logits).item())
    for _ in range(n):
        out.append(y)
        lg = model(mx.array([[y]]), cache=cache)
        y = int(mx.argmax(lg[0, -1]).item())
    return out


def bench_fidelity(cfg: dict, R: int) -> dict:
    from mlx_lm.models import cache as C

    from kvstore.adapters.generate import fetch_cache, model_key, prefill, store_cache
    from kvstore import PrefixStore

    c = cfg["fidelity"]
    res: dict[str, Any] = {"prompts": c["prompts"], "prompt_len": c["prompt_len"], "stored_prefix": c["prefix"],
                           "greedy_tokens": c["gen"], "models": {}}
    for kind in c["kinds"]:
        model, tok, path = load_tiny(kind)
        mkey = model_key(model, path)
        vocab = model.args.vocab_size
        rng = np.random.default_rng(60)
        prompts = [rand_tokens(rng, c["prompt_len"], vocab).tolist() for _ in range(c["prompts"])]
        cold = []
        for p in prompts:
            cache = C.make_prompt_cache(model)
            lg = run_tokens(model, cache, p)
            cold.append((lg, _greedy(model, cache, lg, c["gen"])))
        rows = {}
        for codec in c["codecs"]:
            errs, kls, top1, greedy_prefix, greedy_pos, hits = [], [], [], [], [], []
            for p, (lg0, g0) in zip(prompts, cold):
                store = PrefixStore(budget_gb=1, block_size=256, kv_bits=codec)
                cache0 = C.make_prompt_cache(model)
                prefill(model, cache0, p, 0, c["prefix"], store=store, key=mkey)
                store_cache(store, mkey, p[:c["prefix"]], cache0)
                store.flush()
                got = fetch_cache(store, model, mkey, p)
                hits.append(got.cached_tokens)
                lg = run_tokens(model, got.cache, p[got.cached_tokens:])
                g = _greedy(model, got.cache, lg, c["gen"])
                store.close()
                errs.append(float(mx.max(mx.abs(lg - lg0)).item()))
                lp0 = lg0 - mx.logsumexp(lg0)
                lp = lg - mx.logsumexp(lg)
                kls.append(float(mx.sum(mx.exp(lp0) * (lp0 - lp)).item()))
                top1.append(int(mx.argmax(lg).item()) == int(mx.argmax(lg0).item()))
                same = next((i for i, (a, b) in enumerate(zip(g, g0)) if a != b), len(g0))
                greedy_prefix.append(same / len(g0))
                greedy_pos.append(float(np.mean([a == b for a, b in zip(g, g0)])))
            rows[_codec_name(codec)] = {
                "max_abs_logit_err": max(errs), "mean_abs_logit_err_max": float(np.mean(errs)),
                "kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)), "top1_agree": float(np.mean(top1)),
                "greedy_identical_prefix": float(np.mean(greedy_prefix)), "greedy_position_agree": float(np.mean(greedy_pos)),
                "cached_tokens": hits,
            }
        res["models"][kind] = rows
        log(f"fidelity: {kind} done")
    return res


# ========================================================================= docs


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x != x:
            return "-"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def _ok(b: bool) -> str:
    return "**met**" if b else "**not met**"


def summary_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(what, result, target, met) rows for the headline table."""
    rows = []
    p = results.get("restore")
    if p:
        for name, e in p["entries"].items():
            r = e["ratio"]
            rows.append((f"restore {name}: RAM fetch", f"{e['ram']['gbps']:.2f} GB/s = {r['ram_vs_numpy_memcpy']:.2f}x numpy "
                         f"memcpy, {r['ram_vs_mx_array_copy']:.2f}x mx.array copy", ">= 0.5x memcpy",
                         _ok(r["ram_vs_numpy_memcpy"] >= 0.5) + " (numpy) / " + _ok(r["ram_vs_mx_array_copy"] >= 0.5) + " (mx)"))
            proto = r.get("ssd_page_cached_numpy_assemble_vs_read")
            rows.append((f"restore {name}: SSD page-cached", f"{e['ssd_page_cached']['gbps']:.2f} GB/s = "
                         f"{r['ssd_page_cached_vs_read']:.2f}x plain read"
                         + (f" (numpy-assemble prototype: {proto:.2f}x)" if proto else ""), ">= 0.4x",
                         _ok(r["ssd_page_cached_vs_read"] >= 0.4)
                         + (f" (prototype: {_ok(proto >= 0.4)})" if proto else "")))
            rows.append((f"restore {name}: SSD cold", f"{e['ssd_cold']['gbps']:.2f} GB/s = {r['ssd_cold_vs_read_cold']:.2f}x "
                         f"plain cold read (I/O path with LMDB readahead off: {r['ssd_cold_ra_off_vs_read_cold']:.2f}x, "
                         f"on: {r['ssd_cold_ra_on_vs_read_cold']:.2f}x)", ">= 0.7x", _ok(r["ssd_cold_vs_read_cold"] >= 0.7)))
            if "ram_quantized" in e:
                rows.append((f"restore {name}: handed over Quantized (no dequantize)",
                             f"RAM {r['ram_quantized_vs_numpy_memcpy']:.2f}x memcpy, SSD cached "
                             f"{r['ssd_page_cached_quantized_vs_read']:.2f}x read, SSD cold "
                             f"{r['ssd_cold_quantized_vs_read_cold']:.2f}x; dequantized fetch is "
                             f"{r['dequantized_vs_quantized_time']:.0f}x slower", "0.5 / 0.4 / 0.7",
                             f"{_ok(r['ram_quantized_vs_numpy_memcpy'] >= 0.5)} / "
                             f"{_ok(r['ssd_page_cached_quantized_vs_read'] >= 0.4)} / "
                             f"{_ok(r['ssd_cold_quantized_vs_read_cold'] >= 0.7)}"))
    p = results.get("lookup")
    if p:
        rows.append((f"lookup: contains() of {p['prompt_tokens'] // 1024}K tokens, {p['blocks_indexed']:,} blocks",
                     f"{p['contains_np']['median_s'] * 1e3:.3f} ms (np tokens), {p['contains_list']['median_s'] * 1e3:.3f} ms "
                     f"(list)", "< 1 ms", _ok(p["met"]) + ("" if p["met_list_input"] else " (list input: not met)")))
    p = results.get("put")
    if p:
        rows.append((f"put: blocking, {p['shape']['tokens'] // 1024}K tokens ({p['bytes'] / MiB:,.0f} MiB)",
                     f"{p['blocking_ssd_store']['median_s'] * 1e3:.3f} ms", "< 1 ms", _ok(p["met"])))
        rows.append(("put: background to SSD", f"{p['background_to_ssd']['gbps']:.2f} GB/s = "
                     f"{p['ratio_background_vs_plain_write']:.2f}x plain write+fsync", "-", "-"))
    p = results.get("ttft")
    if p:
        for n, e in p["lengths"].items():
            rows.append((f"ttft {int(n) // 1024}K: kvstore RAM / SSD / LRU hit vs cold",
                         f"{e['speedup_vs_cold']['kvstore_ram']:.0f}x / {e['speedup_vs_cold']['kvstore_ssd']:.0f}x / "
                         f"{e['speedup_vs_cold']['lru_prompt_cache']:.0f}x faster; kvstore RAM = "
                         f"{e['kvstore_ram_vs_lru']:.2f}x LRU's TTFT", "-", "-"))
    p = results.get("replay")
    if p:
        for b in p.get("budgets", []):
            sy = b["systems"]
            s = sy["kvstore_q8_ssd"]
            rows.append((f"replay, RAM budget {b['budget_frac']:.0%} of the working set: tokens recomputed, "
                         f"kvstore q8+SSD vs LRUPromptCache",
                         f"{s['recompute_vs_lru']:.3f}x ({s['recomputed_tokens']:,} vs {sy['lru']['recomputed_tokens']:,}; "
                         f"fp16 {sy['kvstore_fp16']['recompute_vs_lru']:.2f}x, q8 {sy['kvstore_q8']['recompute_vs_lru']:.2f}x, "
                         f"unbounded cache {p['ideal']['recomputed_tokens']:,}); total TTFT "
                         f"{s['ttft_total_vs_lru']:.2f}x", "<= 0.333x", _ok(b["met"])))
    return rows


def reading_notes(results: dict) -> list[str]:
    """What limits each figure (mechanisms measured in this project; see the sections)."""
    n = []
    ents = results.get("restore", {}).get("entries", {})
    fp = ents.get("fp16", {})
    proto = (fp["ssd_page_cached"]["median_s"] / fp["ssd_page_cached_numpy_assemble"]["median_s"]
             if "ssd_page_cached_numpy_assemble" in fp else float("nan"))
    shares = [e["dequant_share_of_ram_fetch"] for e in ents.values() if "dequant_share_of_ram_fetch" in e]
    speed = [e["ratio"]["dequantized_vs_quantized_time"] for e in ents.values()
             if "dequantized_vs_quantized_time" in e.get("ratio", {})]
    qmet = [k for k, e in ents.items() if e.get("ratio", {}).get("ram_quantized_vs_numpy_memcpy", 0) >= 0.5]
    if "restore" in results:
        n.append("**RAM fetch is bounded by page faults on fresh mlx buffers, spread over the cores.** A fetch "
                 "writes the prefix into new mlx buffers. On Linux, glibc serves buffers over 32 MiB with fresh "
                 "`mmap`s and mlx's CPU allocator asks for no transparent huge pages (THP is `madvise` here), so "
                 "each 4 KiB page faults on first write: a 256 MiB `mx.array` copy takes 65,536 minor faults and "
                 "runs at ~1.3 GB/s, numpy's copy (which madvises huge pages) at ~5-7 GB/s. `fetch` concatenates "
                 "the layers side by side on every core (`kvstore/spread.py`: one mlx stream per worker thread), "
                 "which roughly doubled it on these 2 cores and puts it well above one `mx.array` copy.")
        n.append("**SSD page-cached fetch makes two copies**: `mx.array` per block in `deserialize` (in the "
                 "calling thread: decoding blocks on worker threads measured no faster, the copy holds the GIL), "
                 "then the per-layer concatenation, spread over the cores. Assembling each layer with numpy "
                 "straight from the LMDB mmap views and copying once into mlx (prototype, timed in the same run) "
                 f"runs at {proto:.1f}x of `fetch`'s speed; it would skip the per-block copy that promotion to RAM "
                 "needs, so it only pays where nothing is promoted.")
        n.append("**Cold SSD reads depend on LMDB readahead.** With `readahead=False` every 4 KiB page of a "
                 "multi-MiB block is a separate synchronous read (~0.05 GB/s here); with readahead on, the kernel "
                 "reads ahead (8 MiB on this VM). 'Cold' is cold in the guest only: the VM's host may cache the "
                 "disk, so plain cold reads vary between ~0.4 and ~1.9 GB/s from run to run.")
        n.append("**Serving quantized entries to a dense engine is dequantize-bound on a CPU** "
                 f"({min(shares or [0]):.0%}-{max(shares or [0]):.0%} of the RAM fetch): handed over as `Quantized` "
                 "(an engine running `kv_bits` / `QuantizedKVCache` needs no dequantize) the same fetch is "
                 f"{min(speed or [0]):.0f}-{max(speed or [0]):.0f}x faster"
                 + (f" and meets the RAM target for {', '.join(qmet)}." if qmet else ".")
                 + " kvstore's dequantize is bit-exact with `mx.dequantize` and ~1.5x faster on one core (byte "
                 "unpacking, fp32 math rounded where mlx's half kernel rounds); `fetch` runs it on every core. "
                 "Numpy paths in fp32 are faster still but differ from `mx.dequantize` by one fp16 ulp, and "
                 "`mx.compile` of the same graph was slower here (0.14 vs 0.32 GB/s); on Apple silicon mlx's GPU "
                 "kernel does this at memory speed.")
    if "lookup" in results:
        n.append("**Lookup:** walk + hashing of a 128K-token prompt stays under 1 ms for an int32 array; a Python "
                 "list costs 3-6 ms more just to convert (`as_tokens`), so engines should pass arrays.")
    if "put" in results:
        n.append("**Put** blocks only for hashing and indexing. The background thread (one, so the engine keeps "
                 "the other cores) copies each block out of the engine's buffers, writes it into its serialized "
                 "buffer once, checksums it and hands it to LMDB (write + fsync): three passes over the bytes "
                 "where a plain file write makes one.")
    if "ttft" in results:
        n.append("**TTFT hits** on the tiny llama (512 B of KV per token) are dominated by per-request fixed costs "
                 "(a decode step, cache rebuild), so kvstore and `LRUPromptCache` hits land within noise of each "
                 "other; both are two to three orders of magnitude faster than a cold prefill. The restore part "
                 "measures the KV-size-dependent cost on a Llama-3-8B-shaped set.")
    if "replay" in results:
        n.append("**Replay:** the 'unbounded' row is what any exact prefix cache of unlimited size could serve "
                 "(the new tokens of each turn, plus each system prompt once); kvstore q8 + SSD reaches it at every "
                 "budget. LRUPromptCache keeps one full copy per conversation (system prompt included) in fp16, "
                 "kvstore shares blocks between conversations, stores 8-bit entries in about half the bytes and "
                 "keeps what RAM evicts on SSD.")
    return n


def write_docs(results: dict, meta: dict, out: Path, docs: Path) -> Path:
    docs.mkdir(parents=True, exist_ok=True)
    img = docs / "bench"
    img.mkdir(exist_ok=True)
    for png in out.glob("*.png"):
        shutil.copy(png, img / png.name)
    L: list[str] = []
    a = L.append
    a("# Benchmarks\n")
    a(f"Generated by `python tools/bench.py` ({meta['mode']} run, {meta['date']}, "
      f"{meta['runtime_s'] / 60:.1f} min of benchmarks). Machine: {meta['machine']}; "
      f"mlx {meta['mlx']} (CPU), mlx-lm {meta['mlx_lm']}, Python {meta['python']}.\n")
    dates = meta.get("part_dates", {})
    if len(set(dates.values())) > 1:
        a("Parts come from different runs: "
          + ", ".join(f"{p} {d}" for p, d in dates.items()) + ".\n")
    a("Every figure is the median over repeats; every baseline was measured in the same run, so read the ratios. "
      "Absolute numbers are from mlx on a shared 2-core Linux CPU, where mlx's own kernels are slow "
      "(fp16 elementwise ~0.3 GB/s, matmul ~5 GFLOP/s vs 75 for numpy/OpenBLAS): model time here is far from "
      "Apple silicon, memory and disk time less so.\n")
    a("## Summary\n")
    a("| what | result | target | |")
    a("|---|---|---|---|")
    for r in summary_rows(results):
        a("| " + " | ".join(r) + " |")
    a("")
    notes = reading_notes(results)
    if notes:
        a("## Reading the results\n")
        for n in notes:
            a(f"- {n}")
        a("")
    p = results.get("restore")
    if p:
        sh = p["shape"]
        a("## restore: fetch throughput\n")
        a(f"Llama-3-8B-shaped layer set: {sh['layers']} layers x {sh['heads']} KV heads x head_dim {sh['dim']} x "
          f"{sh['tokens']} tokens ({p['fp16_bytes'] / MiB:,.0f} MiB fp16), block size 256. GB/s are of *stored* bytes "
          "(what the tier holds), per `fetch` of the whole prefix into ready mlx arrays. SSD: a store opened with "
          "`budget_gb=0` so nothing is promoted to RAM; cold = the LMDB file's pages dropped with "
          "`posix_fadvise(DONTNEED)` and the store reopened before each fetch. Baselines on the same byte count: "
          "numpy copy (alloc + memcpy), `mx.array(numpy)` copy, a plain `readinto` of a file of the same size "
          "(page-cached and cold).\n")
        res_pre = [x for e in p["entries"].values() for x in e["ssd_cold"].get("resident_before_fetch", [])]
        a(f"kvstore opened LMDB with `readahead={p.get('lmdb_readahead')}` in this run. Opening the store reads its index, "
          f"and kernel readahead (`read_ahead_kb` = {p.get('read_ahead_kb', '?')} here) brings part of the file back "
          f"before the timed cold fetch: median {np.median(res_pre) if res_pre else float('nan'):.0%} of data.mdb was "
          "resident (recorded per repeat in restore.json).\n")
        a("Fetch, GB/s (entries as stored; *Quantized* = `quantized=(bits, 64)`, handed over without dequantizing; "
          "*I/O path* = the same cold fetch (Quantized for quantized entries) with LMDB's readahead forced off / on):\n")
        a("| entries | stored MiB | RAM | RAM Quantized | SSD cached | SSD cached Quantized | SSD cold | "
          "SSD cold Quantized | I/O path cold, RA off | I/O path cold, RA on |")
        a("|---|---|---|---|---|---|---|---|---|---|")
        g = lambda e, k: _fmt(e.get(k, {}).get("gbps"))  # noqa: E731
        for name, e in p["entries"].items():
            a(f"| {name} | {e['stored_bytes'] / MiB:,.0f} | {g(e, 'ram')} | {g(e, 'ram_quantized')} | "
              f"{g(e, 'ssd_page_cached')} | {g(e, 'ssd_page_cached_quantized')} | {g(e, 'ssd_cold')} | "
              f"{g(e, 'ssd_cold_quantized')} | {g(e, 'ssd_cold_ra_off')} | {g(e, 'ssd_cold_ra_on')} |")
        a("")
        a("Baselines on the same byte counts, GB/s:\n")
        a("| entries | numpy memcpy | mx.array copy | plain read, page-cached | plain read, cold |")
        a("|---|---|---|---|---|")
        for name, e in p["entries"].items():
            b = e["baselines"]
            a(f"| {name} | {b['numpy_copy']['gbps']:.2f} | {b['mx_array_copy']['gbps']:.2f} | "
              f"{b['read_page_cached']['gbps']:.2f} | {b['read_cold']['gbps']:.2f} |")
        a("")
        a("Ratios (same bytes):\n")
        a("| entries | RAM / numpy memcpy | RAM / mx.array copy | RAM Quantized / numpy memcpy | SSD cached / read | "
          "SSD cached Quantized / read | SSD cold / cold read | SSD cold Quantized / cold read | "
          "I/O path RA off / cold read | I/O path RA on / cold read | dequantized / Quantized fetch time | "
          "dequantize share of RAM fetch |")
        a("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, e in p["entries"].items():
            r = e["ratio"]
            a(f"| {name} | {r['ram_vs_numpy_memcpy']:.2f} | {r['ram_vs_mx_array_copy']:.2f} | "
              f"{_fmt(r.get('ram_quantized_vs_numpy_memcpy'))} | {r['ssd_page_cached_vs_read']:.2f} | "
              f"{_fmt(r.get('ssd_page_cached_quantized_vs_read'))} | {r['ssd_cold_vs_read_cold']:.2f} | "
              f"{_fmt(r.get('ssd_cold_quantized_vs_read_cold'))} | {r['ssd_cold_ra_off_vs_read_cold']:.2f} | "
              f"{r['ssd_cold_ra_on_vs_read_cold']:.2f} | "
              f"{_fmt(r.get('dequantized_vs_quantized_time'))} | {_fmt(e.get('dequant_share_of_ram_fetch'))} |")
        a("")
        e = p["entries"].get("fp16", {})
        if "ssd_page_cached_numpy_assemble" in e:
            a(f"Prototype (fp16, page-cached): assembling each layer with numpy straight from the LMDB mmap views and "
              f"copying once into mlx takes {e['ssd_page_cached_numpy_assemble']['median_s'] * 1e3:.0f} ms vs "
              f"{e['ssd_page_cached']['median_s'] * 1e3:.0f} ms for `fetch` "
              f"({e['ssd_page_cached']['median_s'] / e['ssd_page_cached_numpy_assemble']['median_s']:.1f}x faster, "
              f"{e['ratio']['ssd_page_cached_numpy_assemble_vs_read']:.2f}x plain read).\n")
        dq = [(n, e["dequant_paths"]) for n, e in p["entries"].items() if e.get("dequant_paths")]
        if dq:
            a("Dequantize paths for the whole fetched set (GB/s of fp16 output; speed-up vs kvstore's bit-exact "
              "`Quantized.dequantize` on one core; max |diff| vs `mx.dequantize`; `fetch` runs the second row):\n")
            a("| entries | path | GB/s out | speed-up | max abs diff |")
            a("|---|---|---|---|---|")
            for n, d in dq:
                for path, v in d.items():
                    a(f"| {n} | {path} | {v['gbps']:.2f} | {v['speedup_vs_shipped']:.2f}x | "
                      f"{v['max_abs_diff_vs_mx_dequantize']:.2g} |")
            a("")
        a("![restore](bench/restore.png)\n")
    p = results.get("lookup")
    if p:
        a("## lookup: index walk + hashing\n")
        a(f"A {p['prompt_tokens']:,}-token prompt ({p['prompt_blocks']} blocks of {p['block_size']}, real KV) in an index "
          f"of {p['blocks_indexed']:,} blocks (filler chains added through `RadixIndex.add`).\n")
        a("| measurement | median |")
        a("|---|---|")
        for k, label in (("hash_only_np", "key hashing only (int32 array)"), ("as_tokens_list", "`as_tokens` of a Python list"),
                         ("hash_only_list", "key hashing from a Python list"), ("walk_only", "index walk only (keys precomputed)"),
                         ("contains_np", "`contains` (walk + hashing), int32 array"), ("contains_list", "`contains`, Python list"),
                         ("contains_partial_np", "`contains`, prompt diverging inside the last block"),
                         ("contains_next_turn_np", "`contains`, stored prompt + 700 new tokens"),
                         ("contains_miss_np", "`contains`, miss at the first block")):
            a(f"| {label} | {p[k]['median_s'] * 1e3:.3f} ms |")
        f = p["fetch_full"]
        a(f"| `fetch` of the whole prompt ({f['kv_bytes'] / MiB:.0f} MiB KV) | {f['median_s'] * 1e3:.1f} ms ({f['gbps']:.2f} GB/s) |")
        a("")
    p = results.get("put")
    if p:
        sh = p["shape"]
        a("## put: caller blocking time and background throughput\n")
        a(f"{sh['tokens']:,} tokens x {sh['layers']} layers x {sh['heads']} KV heads x head_dim {sh['dim']} "
          f"({p['bytes'] / MiB:,.0f} MiB fp16), block size 256, RAM + SSD store.\n")
        a("| measurement | median |")
        a("|---|---|")
        a(f"| `put` blocking (RAM + SSD store) | {p['blocking_ssd_store']['median_s'] * 1e3:.3f} ms |")
        a(f"| `put` blocking (RAM-only store) | {p['blocking_ram_store']['median_s'] * 1e3:.3f} ms |")
        a(f"| `put` of an already stored prefix | {p['blocking_already_stored']['median_s'] * 1e3:.3f} ms |")
        a(f"| first `put` of a model key in a store (registers it in LMDB, 256 tokens) | "
          f"{p['blocking_first_put_of_model']['median_s'] * 1e3:.3f} ms |")
        a(f"| put -> flush (encode + write to LMDB) | {p['background_to_ssd']['median_s']:.2f} s = "
          f"{p['background_to_ssd']['gbps']:.2f} GB/s |")
        a(f"| plain file write + fsync, same bytes | {p['plain_write_fsync']['gbps']:.2f} GB/s |")
        q = p["q8"]
        a(f"| 8-bit entries, {q['tokens']:,} tokens: blocking | {q['blocking']['median_s'] * 1e3:.3f} ms |")
        a(f"| 8-bit entries: put -> flush (quantize + write) | {q['background_to_ssd']['gbps']:.2f} GB/s of fp16 input |")
        a("")
    p = results.get("ttft")
    if p:
        a("## ttft: time to first token\n")
        a(f"{p['model']}. Cold = plain `mlx_lm.stream_generate`; kvstore = `adapters.generate.generate` "
          "(fetch + rebuild cache + last token); SSD = store closed and reopened before each request (cold: "
          "LMDB pages dropped too); LRU = `LRUPromptCache.fetch_nearest_cache` (deep copy + trim) + "
          "`stream_generate` of the rest. Every hit serves all but the last prompt token.\n")
        a("| prompt tokens | cold | kvstore RAM | kvstore SSD | kvstore SSD cold | LRUPromptCache | RAM speed-up | kvstore RAM / LRU |")
        a("|---|---|---|---|---|---|---|---|")
        for n, e in p["lengths"].items():
            a(f"| {int(n):,} | {e['cold']['median_s'] * 1e3:,.0f} ms | {e['kvstore_ram']['median_s'] * 1e3:.1f} ms | "
              f"{e['kvstore_ssd']['median_s'] * 1e3:.1f} ms | {e['kvstore_ssd_cold']['median_s'] * 1e3:.1f} ms | "
              f"{e['lru_prompt_cache']['median_s'] * 1e3:.1f} ms | {e['speedup_vs_cold']['kvstore_ram']:.0f}x | "
              f"{e['kvstore_ram_vs_lru']:.2f} |")
        a("")
        a("![ttft](bench/ttft.png)\n")
    p = results.get("replay")
    if p:
        t = p["trace"]
        budgets_mib = ", ".join(f"{b['ram_budget_bytes'] / MiB:.2f} MiB" for b in p["budgets"])
        budgets_pct = ", ".join(f"{b['budget_frac']:.0%}" for b in p["budgets"])
        a("## replay: many users, one RAM budget (headline)\n")
        a(f"Seeded trace: {p['sessions']} sessions ({p['chat_sessions']} chats, {p['agent_sessions']} agent loops) on "
          f"{len(t['sys_lens'])} shared system prompts of {', '.join(map(str, t['sys_lens']))} tokens, "
          f"{t['concurrency']} sessions active at a time and interleaved at random; chat turns add a user message "
          f"({t['user'][0]}-{t['user'][1]} tokens) and a response ({t['resp'][0]}-{t['resp'][1]}); agent steps add a "
          f"tool output ({t['tool'][0]}-{t['tool'][1]}) and an action ({t['action'][0]}-{t['action'][1]}). "
          f"{p['requests']} requests, {p['prompt_tokens']:,} prompt tokens, {p['unique_tokens']:,} distinct tokens = "
          f"{p['working_set_fp16_bytes'] / MiB:.1f} MiB of fp16 KV. Every system gets the same RAM byte budget: "
          f"{budgets_mib} ({budgets_pct} of the working set; the first is the headline).\n")
        a("Each request really runs the tiny llama: look up, restore, prefill the rest, first token (TTFT), then the "
          "trace's response is fed (teacher-forced) and the cache of prompt + response goes back "
          "(`insert_cache`, as mlx-lm's server does, or `put`).\n")
        a("| RAM budget | system | tokens recomputed | vs LRU | token hit rate | TTFT total | p50 | p95 | "
          "resident RAM max |")
        a("|---|---|---|---|---|---|---|---|---|")
        for b in p["budgets"]:
            for name, _ in REPLAY_SYSTEMS:
                s = b["systems"][name]
                a(f"| {b['ram_budget_bytes'] / MiB:.2f} MiB ({b['budget_frac']:.0%}) | {s['label']} | "
                  f"{s['recomputed_tokens']:,} | {s['recompute_vs_lru']:.3f} | {s['token_hit_rate']:.1%} | "
                  f"{s['ttft_total_s']:.1f} s | {s['ttft_p50_s'] * 1e3:.0f} ms | {s['ttft_p95_s'] * 1e3:.0f} ms | "
                  f"{s['resident_ram_bytes_max'] / MiB:.2f} MiB |")
        a(f"| unbounded | (any exact prefix cache) | {p['ideal']['recomputed_tokens']:,} | "
          f"{p['ideal']['recomputed_tokens'] / max(1, p['systems']['lru']['recomputed_tokens']):.3f} | "
          f"{p['ideal']['token_hit_rate']:.1%} | | | | |")
        a("")
        a("![replay](bench/replay.png)\n")
    p = results.get("fidelity")
    if p:
        a("## fidelity: quantized entries vs a cold prefill\n")
        a(f"{p['prompts']} prompts of {p['prompt_len']} tokens per model; the first {p['stored_prefix']} tokens are "
          "prefilled and stored with the codec, fetched back (dequantized to fp16), the rest of the prompt runs on the "
          f"restored cache. Compared with one cold prefill: last-token logits (max |error|, KL(cold || restored)), "
          f"top-1 agreement, and {p['greedy_tokens']} greedy tokens (identical prefix fraction). The fp16 row is the "
          "noise floor (the stored prefix was prefilled in other chunks than the cold run).\n")
        a("| model | entries | max abs logit err | mean KL | max KL | top-1 agree | greedy identical |")
        a("|---|---|---|---|---|---|---|")
        for kind, rows in p["models"].items():
            for cname, r in rows.items():
                a(f"| {kind} | {cname} | {r['max_abs_logit_err']:.4f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
                  f"{r['top1_agree']:.0%} | {r['greedy_identical_prefix']:.0%} |")
        a("")
    a("## Reproduce\n")
    a("```\npython tools/bench.py            # full run, rewrites this page\n"
      "python tools/bench.py --quick    # small sizes, < 5 min, JSON + PNG in bench-out/\n"
      "python tools/bench.py --only replay --out /tmp/b\n```\n")
    path = docs / "benchmarks.md"
    from kvstore.tools.fidelity import kept_section

    kept = kept_section(path)  # the trained-model fidelity section is written by tools/fidelity.py: keep it
    path.write_text("\n".join(L) + (f"\n{kept}\n" if kept else ""))
    return path


# ========================================================================= main


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{mem}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench", description="kvstore benchmarks (see tools/bench.py docstring).")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (< 5 min on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, for tests (seconds)")
    ap.add_argument("--only", nargs="+", choices=PARTS, metavar="PART", help=f"parts to run: {', '.join(PARTS)}")
    ap.add_argument("--out", default="bench-out", help="output folder for JSON and PNG (default: bench-out)")
    ap.add_argument("--repeats", type=int, help="repeats per measurement (default: mode's)")
    ap.add_argument("--tmp", help="where SSD stores and scratch files go (default: system temp)")
    ap.add_argument("--write-docs", action="store_true", help="write docs/benchmarks.md (default: full runs only)")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help=argparse.SUPPRESS)
    ap.add_argument("--merge", metavar="RESULTS_JSON",
                    help="take the parts not run now from an earlier results.json (its plots from its folder)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    cfg = SIZES[mode]
    R = args.repeats or cfg["repeats"]
    parts = list(args.only) if args.only else list(PARTS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.tmp))
    import mlx_lm

    meta = {"mode": mode, "parts": parts, "repeats": R, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": _machine(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "python": platform.python_version(), "argv": list(argv) if argv is not None else sys.argv[1:]}
    results: dict[str, Any] = {}
    plots: list[str] = []
    t_all = time.perf_counter()
    try:
        for part in parts:
            t0 = time.perf_counter()
            log(f"== {part} ({mode})")
            if part == "restore":
                r = bench_restore(cfg, R, tmp)
                plots += plot_restore(r, out)
            elif part == "lookup":
                r = bench_lookup(cfg, R)
            elif part == "put":
                r = bench_put(cfg, R, tmp)
            elif part == "ttft":
                r = bench_ttft(cfg, R, tmp)
                plots += plot_ttft(r, out)
            elif part == "replay":
                r = bench_replay(cfg, R, tmp)
                plots += plot_replay(r, out)
            else:
                r = bench_fidelity(cfg, R)
            r["runtime_s"] = time.perf_counter() - t0
            results[part] = r
            (out / f"{part}.json").write_text(json.dumps(r, indent=1, default=str))
            log(f"== {part} done in {r['runtime_s']:.1f} s")
            gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["runtime_s"] = time.perf_counter() - t_all
    meta["part_dates"] = {p: meta["date"] for p in results}
    if args.merge:
        prev = json.loads(Path(args.merge).read_text())
        for part, r in prev["parts"].items():
            if part not in results:
                results[part] = r
                meta["part_dates"][part] = prev["meta"].get("part_dates", {}).get(part, prev["meta"]["date"])
                for png in Path(args.merge).parent.glob(f"{part}.png"):
                    if png.resolve() != (out / png.name).resolve():
                        shutil.copy(png, out / png.name)
                    plots.append(png.name)
        results = {p: results[p] for p in PARTS if p in results}
        meta["merged_from"] = str(args.merge)
        meta["mode"] = prev["meta"]["mode"] if mode == prev["meta"]["mode"] else f"{mode}+{prev['meta']['mode']}"
        meta["runtime_s"] = sum(r.get("runtime_s", 0) for r in results.values())
    meta["plots"] = plots
    (out / "results.json").write_text(json.dumps({"meta": meta, "parts": results}, indent=1, default=str))
    rows = summary_rows(results)
    if rows:
        print("| what | result | target | |\n|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    if (mode == "full" and not args.only) or args.write_docs:
        p = write_docs(results, meta, out, Path(args.docs))
        log(f"wrote {p}")
    log(f"total {meta['runtime_s']:.1f} s; results in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
