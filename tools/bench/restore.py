"""restore: fetch GB/s from the RAM tier and the SSD tier (page-cached and
cold) for fp16 / 8-bit / 4-bit entries, vs memcpy and a plain read of a file of
the same size; quantized hand-over vs dequantize, and faster dequantize paths."""

from __future__ import annotations

import contextlib
import gc
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .common import (MiB, drop_page_cache, lmdb_readahead, lmdb_readahead_flag, log, memcpy_baselines, page_facts,
                     plain_read, read_ahead_kb, resident_fraction, restore_workload, stat, timed, write_file)

SHIPPED = "kvstore Quantized.dequantize, one core"
COMPILED = "the same under mx.compile, one core"
MX_KERNEL = "mx.dequantize (mlx CPU kernel)"
BLOCK = 256
GROUP = 64  # quantization group of the stored entries (the store's default)


def _np_dequant(q):
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
    from kvstore.blocks.layers import Quantized, dequantize
    from kvstore.convert.spread import spread

    qs = [t for l in hit_q.layers for t in (l.keys, l.values) if isinstance(t, Quantized)]
    if not qs or qs[0].bits not in (8, 4):
        return {}
    gs, bits = qs[0].group_size, qs[0].bits
    ref = [mx.dequantize(q.data, q.scales, q.biases, group_size=gs, bits=bits) for q in qs]
    mx.eval(ref)
    compiled_dequantize = mx.compile(lambda d, s, b: dequantize(d, s, b, gs, bits))

    def evaluated(make):
        def fn():
            out = [make(q) for q in qs]
            mx.eval(out)
            return out
        return fn

    pool = ThreadPoolExecutor(2)

    def np_2():
        out = list(pool.map(lambda q: mx.array(_np_dequant(q)), qs))
        mx.eval(out)
        return out

    res = {}
    for name, fn in ((SHIPPED, evaluated(lambda q: q.dequantize())),
                     ("the same on every core (kvstore.convert.spread, as fetch runs it)",
                      lambda: spread([q.dequantize for q in qs])),
                     (COMPILED, evaluated(lambda q: compiled_dequantize(q.data, q.scales, q.biases))),
                     (MX_KERNEL, evaluated(lambda q: mx.dequantize(q.data, q.scales, q.biases, group_size=gs,
                                                                   bits=bits))),
                     ("mx.dequantize, f32 scales -> fp16",
                      evaluated(lambda q: mx.dequantize(q.data, q.scales.astype(mx.float32),
                                                        q.biases.astype(mx.float32), group_size=gs,
                                                        bits=bits).astype(mx.float16))),
                     ("numpy f32 -> mx.array", evaluated(lambda q: mx.array(_np_dequant(q)))),
                     ("numpy f32 x2 threads -> mx.array", np_2)):
        out = fn()
        err = max(float(mx.max(mx.abs(a.astype(mx.float32) - r.astype(mx.float32))).item()) for a, r in zip(out, ref))
        del out
        res[name] = dict(stat(timed(fn, R, warmup=0), nbytes_out), max_abs_diff_vs_mx_dequantize=err)
    pool.shutdown()
    base = res[SHIPPED]["median_s"]
    for v in res.values():
        v["speedup_vs_shipped"] = base / v["median_s"]
    return res


def _ssd_numpy_assemble(disk, block_size: int, key: str, toks: np.ndarray, namespace=None) -> list:
    """Prototype of a faster SSD fetch (dense entries, full blocks only): read
    every block's payload view in one LMDB transaction, check it, concatenate
    each layer's rows with numpy straight from the mmap views (one memcpy that
    numpy backs with huge pages), then one ``mx.array`` copy per tensor —
    instead of ``mx.array`` per block and ``mx.concatenate`` per layer."""
    import xxhash

    from kvstore.blocks.hashing import KeyChain, root_key
    from kvstore.blocks.header import read_header

    bs = block_size
    chain = KeyChain(root_key(key, namespace), toks, bs)
    with disk.reader() as txn:
        views = []
        for i in range(len(toks) // bs):
            buf = memoryview(disk.payload(txn, chain.key(i)))
            h = read_header(buf)
            pl = buf[h.payload_start:]
            if xxhash.xxh3_64_intdigest(pl) != h.checksum:
                raise ValueError("checksum")
            if not np.array_equal(h.tokens.view(pl), toks[i * bs:(i + 1) * bs]):
                raise ValueError("tokens")
            views.append((h, pl))
        out = []
        for li in range(len(views[0][0].layers)):
            kv = []
            for which in ("keys", "values"):
                parts = [getattr(h.layers[li], which).arrays[0].view(pl) for h, pl in views]
                kv.append(mx.array(np.concatenate(parts, axis=-2)))
            out.append(kv)
        mx.eval(out)
    return out


def run(cfg: dict, R: int, tmp: Path) -> dict:
    from kvstore import PrefixStore
    from kvstore.tiers.disk.lmdb import LmdbTier

    c, layers, toks, out_bytes = restore_workload(cfg)
    key = "bench-restore"
    res: dict[str, Any] = {"shape": dict(c, block_size=BLOCK, group_size=GROUP, dtype="float16"), "fp16_bytes": out_bytes, "entries": {},
                           "lmdb_readahead": lmdb_readahead_flag(tmp), "read_ahead_kb": read_ahead_kb(tmp),
                           **page_facts()}
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
        store = PrefixStore(budget_gb=64, block_size=BLOCK, kv_bits=bits, kv_group_size=GROUP)
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
            e["ram_quantized"] = stat(timed(lambda: store.fetch(key, toks, quantized=(bits, GROUP)), R, warmup=1), stored)
            hq = store.fetch(key, toks, quantized=(bits, GROUP))
            e["dequant_share_of_ram_fetch"] = 1 - e["ram_quantized"]["median_s"] / e["ram"]["median_s"]
            e["dequant_paths"] = _dequant_paths(hq, Rs, out_bytes)
            del hq
        store.close()
        del store
        gc.collect()
        # --- SSD tier
        path = tmp / f"ssd-{name}"
        store = PrefixStore(budget_gb=64, ssd_path=path, block_size=BLOCK, kv_bits=bits, kv_group_size=GROUP)
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
        ref = store.fetch(key, toks) if bits is None else None
        if bits is not None:
            e["ssd_page_cached_quantized"] = stat(
                timed(lambda: store.fetch(key, toks, quantized=(bits, GROUP)), R, warmup=1), stored)
        store.close()
        if ref is not None:  # the prototype reads the same page-cached file through its own LMDB reader
            disk = LmdbTier(path, readonly=True)
            proto = _ssd_numpy_assemble(disk, BLOCK, key, toks)
            assert all(bool(mx.array_equal(l.keys, k).item()) and bool(mx.array_equal(l.values, v).item())
                       for l, (k, v) in zip(ref.layers, proto))
            del ref, proto
            e["ssd_page_cached_numpy_assemble"] = stat(
                timed(lambda: _ssd_numpy_assemble(disk, BLOCK, key, toks), Rs, warmup=1), stored)
            disk.close()

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

        q = None if bits is None else (bits, GROUP)
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
            e["ratio"]["ram_quantized_vs_numpy_memcpy"] = e["ram_quantized"]["gbps"] / b["numpy_copy"]["gbps"]
            e["ratio"]["ram_quantized_vs_mx_array_copy"] = e["ram_quantized"]["gbps"] / b["mx_array_copy"]["gbps"]
            e["ratio"]["ssd_page_cached_quantized_vs_read"] = (
                e["ssd_page_cached_quantized"]["gbps"] / b["read_page_cached"]["gbps"])
            e["ratio"]["dequantized_vs_quantized_time"] = e["ram"]["median_s"] / e["ram_quantized"]["median_s"]
        res["entries"][name] = e
        gc.collect()
    return res
