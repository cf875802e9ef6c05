"""The SSD tier against the machine's own limits, measured in one run.

For each entry type, one prompt's KV (random fp16 rows of a given model
shape) goes through a store on disk, and each figure is a median over
``--repeats`` with a plain baseline of the same bytes in the same run, each
kind back to back (see ``run``):

- ``put_ms``: what ``put`` blocks the caller given an int32 array, as the
  first put into a new store; ``put_later_ms``: as a later one
  (``put_list_ms``: given a Python list; ``put_profile``: where one put's
  time goes); ``flush_GBps``: put -> on disk (written and committed) in a
  serving store's steady state (RAM full: each block kept evicts one; the
  store already holds a prompt), vs the faster of ``write_fsync_appending_GBps``
  (a plain file of one prompt's bytes, then the same bytes appended + fsync)
  and ``write_fsync_GBps`` (a plain file write + fsync);
  ``flush_first_fill_GBps``: the same into a new store (every block kept in
  RAM takes fresh memory); ``flush_disk_only_GBps``: into a store with no
  RAM tier;
- ``first_hit_ms`` / ``later_hit_ms``: the first fetch after a put (blocks the
  writer just admitted to RAM) and the next one, in the steady-state store;
- ``fetch_device`` (CUDA): a hit from the device tier (GPU memory);
- ``fetch_ram``, ``fetch_ssd_cached``, ``fetch_ssd_cold``: a fetch to ready
  arrays (on CUDA: on the device); SSD reads from a store with no RAM tier,
  for cold ones closed and its file dropped from the page cache first;
  ``fetch_ssd_cached_promoting``: a page-cached read by a store with a RAM
  tier, which copies the blocks into RAM on its writer thread meanwhile;
- ``prior_ssd_cold_GBps``: what ``fetch_policy="auto"`` assumes of a cold
  read before it has measured one (a new store opened on the dropped file),
  against ``fetch_ssd_cold_GBps``; ``probe_cold_GBps``: the direct reads of
  the file that prior is made from (``kvstore.cost.probe``), by size and threads;
- baselines: ``read_cached`` / ``read_cold`` (``np.fromfile`` into a fresh
  buffer), and on CUDA the same read followed by mlx's own route to the GPU
  (``mx.array`` + first kernel), which is what an engine without kvstore gets.

    kvstore bench ssd --tokens 8192 --layers 32 --heads 8 --dim 128 --kv fp16 q8 q4 --out DIR

``--parts reads writes`` (the default) or either; ``--parts hot``: only the
RAM and device-tier fetches (a minute-long A/B of the hot path on a GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore import PrefixStore
from kvstore.gpu import cuda
from kvstore.cost import probe
from kvstore.blocks.layers import KVLayer
from kvstore.tools.bench.common import WRITE_CHUNK, drop_page_cache, random_chunk, write_file

KV = {"fp16": None, "q8": 8, "q4": 4}


def _layers(tokens: int, layers: int, heads: int, dim: int, seed: int = 0) -> list[KVLayer]:
    keys = mx.random.split(mx.random.key(seed), 2 * layers)
    out = []
    for i in range(layers):
        k1, k2 = keys[2 * i], keys[2 * i + 1]
        shape = (1, heads, tokens, dim)
        out.append(KVLayer(mx.random.normal(shape, key=k1).astype(mx.float16),
                           mx.random.normal(shape, key=k2).astype(mx.float16)))
    mx.eval([t for l in out for t in (l.keys, l.values)])
    return out


def _ready(hit) -> None:
    arrays = [a for l in hit.layers for t in (l.keys, l.values)
              for a in (t.arrays() if hasattr(t, "arrays") else (t,))]
    mx.eval(arrays)
    mx.synchronize()


def _check(hit, src: list[KVLayer], kind: str) -> None:
    """The KV served is the KV stored: exact for fp16, within quantization
    error otherwise (on these N(0, 1) rows: the largest and the mean error)."""
    tol, mean_tol = {"fp16": (0.0, 0.0), "q8": (0.05, 0.01), "q4": (1.0, 0.15)}[kind]
    for li in (0, len(src) - 1):
        for got, want in ((hit.layers[li].keys, src[li].keys), (hit.layers[li].values, src[li].values)):
            if cuda.runtime() is None:
                # in numpy: mlx temporaries here would leave mlx's buffer cache in another shape for the next
                # timed fetch (26 -> 30-32 ms per 256 MiB fetch on the CPU box)
                diff = np.abs(np.asarray(got, dtype=np.float32) - np.asarray(want, dtype=np.float32))
                err, mean = float(diff.max()), float(diff.mean())
            else:  # on the GPU: numpy would take the arrays' addresses, which moves them into managed memory,
                # and the next fetch would get those buffers back from mlx's cache (docs/benchmarks.md, hot path)
                d = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
                err, mean = d.max().item(), d.mean().item()
            assert got.shape == want.shape and err <= tol and mean <= mean_tol, (kind, li, got.shape, err, mean)


def _timed_fetch(s: PrefixStore, prompt, src: list[KVLayer], kind: str, tier: str) -> float:
    """Seconds of one fetch to ready arrays, served whole from ``tier``
    (``ram_tokens`` / ``ssd_tokens``) and checked against the stored KV."""
    t = time.perf_counter()
    hit = s.fetch("bench", prompt)
    _ready(hit)
    secs = time.perf_counter() - t
    assert getattr(hit, tier) == len(prompt), hit
    _check(hit, src, kind)
    return secs


def _cache_limit() -> int:
    prev = mx.set_cache_limit(0)
    mx.set_cache_limit(prev)
    return prev


def _profile(fn) -> list[str]:
    """The functions one call spends its time in (cProfile, by cumulative
    time, in microseconds: pstats prints whole milliseconds at best)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own s, cumulative s, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][3])[:16]
    return [f"{ct * 1e6:8.0f} us cum {tt * 1e6:8.0f} us own {nc:6d}x {Path(f).name}:{line}({name})"
            for (f, line, name), (_, nc, tt, ct, _) in top]


def _puts(src, prompt: np.ndarray, repeats: int) -> dict:
    """put() in a store that already holds a prompt of this model (the
    engine's steady state), given an int32 array and a Python list; RAM only,
    so the blocks it queues cost no disk time."""
    arr, lst = [], []
    with PrefixStore(budget_gb=1) as s:
        s.put("bench", prompt - 3, src)
        for rep in range(repeats):
            s.flush()
            t = time.perf_counter()
            s.put("bench", prompt + 100_000 * (rep + 1), src)
            arr.append((time.perf_counter() - t) * 1e3)
            s.flush()
            other = (prompt + 200_000 * (rep + 1)).tolist()
            t = time.perf_counter()
            s.put("bench", other, src)
            lst.append((time.perf_counter() - t) * 1e3)
        s.flush()
        profile = _profile(lambda: s.put("bench", prompt + 7, src))
    return {"put_later_ms": statistics.median(arr), "put_later_each_ms": [round(x, 3) for x in arr],
            "put_list_ms": statistics.median(lst), "put_profile": profile}


def _drop(path: Path) -> None:
    for f in path.glob("*.mdb"):
        drop_page_cache(f)


def _gbps(nbytes: int, secs: list[float]) -> float:
    return nbytes / statistics.median(secs) / 1e9


def _fresh(path: Path) -> None:
    """Remove ``path`` and let the file system finish with it before anything
    is timed: on a file system mounted with ``discard`` (this box's), the
    next fsync would otherwise wait for the freed blocks' discards (a 256
    MiB plain write took 560-715 ms instead of 113 ms after a delete)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    os.sync()


def _plain_write(f: Path, nbytes: int, after: int = 0) -> float:
    """Seconds to write ``nbytes`` to a new file and fsync it; with ``after``,
    appended to a file of that many bytes written (untimed) just before, the
    pattern of a put into a store that already holds a prompt."""
    random_chunk(min(WRITE_CHUNK, nbytes))  # the bytes to write, made before the clock starts
    _fresh(f)
    if after:
        write_file(f, after)
    t = time.perf_counter()
    write_file(f, nbytes, append=bool(after))
    return time.perf_counter() - t


def _plain_read(f: Path, cold: bool, into: dict[str, list[float]]) -> None:
    """Seconds to read ``f`` into a fresh buffer (``np.fromfile``), into
    ``read_cold`` / ``read_cached``; on CUDA also to have it on the GPU the
    engine's own way (mx.array, then a kernel reads it), into ``..._to_device``."""
    name = "read_cold" if cold else "read_cached"
    if cold:
        drop_page_cache(f)
    t = time.perf_counter()
    buf = np.fromfile(f, np.uint8)
    into[name].append(time.perf_counter() - t)
    if cuda.runtime() is None:
        return
    step = 1 << 30  # mlx shapes are 32-bit
    parts = [mx.array(buf[o : o + step].view(np.float16)) for o in range(0, len(buf) - len(buf) % 2, step)]
    mx.eval([a[: a.size // 2048 * 2048].reshape(-1, 2048)[:, :1] + 0 for a in parts])
    mx.synchronize()
    into[f"{name}_to_device"].append(time.perf_counter() - t)


def _writes(path: Path, plain: Path, prompt, src, kind: str, repeats: int) -> dict:
    """put -> flushed in three kinds of store, and the plain writes of the
    same bytes, each kind back to back (on this VM, memory one kind frees and
    the host takes back is slow for the next to touch: interleaved, the plain
    write ran at 0.4 GB/s after a store's flush)."""
    t: dict[str, list[float]] = {k: [] for k in ("put", "first_fill", "flush", "first", "later", "disk_only",
                                                 "write_fsync", "write_fsync_appending")}
    stored = 0
    for rep in range(repeats):  # a new store: its RAM tier takes fresh memory for every block
        _fresh(path)
        with PrefixStore(budget_gb=64, ssd_path=path, kv_bits=KV[kind], fetch_policy="always") as s:
            t0 = time.perf_counter()
            s.put("bench", prompt, src)
            t1 = time.perf_counter()
            s.flush()
            t["put"].append((t1 - t0) * 1e3)
            t["first_fill"].append(time.perf_counter() - t0)
            stored = s.stats()["ssd_bytes"]
    # the steady state of a serving store: RAM is full (of one prompt), so each block a put keeps evicts one
    # (and reuses its buffer) while the blocks are written through to disk. A new store per repeat, like the
    # plain write's new file: on this VM a file that keeps growing needs page cache from memory the host took
    # back (0.39 GB/s when each repeat grew one store)
    for rep in range(repeats):
        _fresh(path)
        with PrefixStore(budget_gb=stored / 1e9, ssd_path=path, kv_bits=KV[kind], fetch_policy="always") as s:
            s.put("bench", prompt + 900_000, src)
            s.flush()
            t0 = time.perf_counter()
            s.put("bench", prompt, src)
            s.flush()
            t["flush"].append(time.perf_counter() - t0)
            t["first"].append(_timed_fetch(s, prompt, src, kind, "ram_tokens"))
            t["later"].append(_timed_fetch(s, prompt, src, kind, "ram_tokens"))
    for rep in range(repeats):  # the writer alone: nothing kept in RAM
        _fresh(path)
        with PrefixStore(budget_gb=0, ssd_path=path, kv_bits=KV[kind], fetch_policy="always") as s:
            t0 = time.perf_counter()
            s.put("bench", prompt, src)
            s.flush()
            t["disk_only"].append(time.perf_counter() - t0)
    for rep in range(repeats):
        t["write_fsync"].append(_plain_write(plain, stored))
    for rep in range(repeats):
        t["write_fsync_appending"].append(_plain_write(plain, stored, after=stored))
    row = {"put_ms": statistics.median(t["put"]), **_puts(src, prompt, repeats),
           "first_hit_ms": statistics.median(t["first"]) * 1e3, "later_hit_ms": statistics.median(t["later"]) * 1e3}
    row["first_vs_later"] = row["first_hit_ms"] / row["later_hit_ms"]
    for name, key in (("flush", "flush"), ("first_fill", "flush_first_fill"), ("disk_only", "flush_disk_only"),
                      ("write_fsync", "write_fsync"), ("write_fsync_appending", "write_fsync_appending")):
        row[f"{key}_GBps"] = _gbps(stored, t[name])
        row[f"{key}_each_ms"] = [round(x * 1e3, 1) for x in t[name]]
    # against the faster plain write (a slow repeat of either baseline is this VM's, not the store's gain)
    row["flush_vs_write_fsync"] = row["flush_GBps"] / max(row["write_fsync_appending_GBps"], row["write_fsync_GBps"])
    row["flush_first_fill_vs_write_fsync"] = row["flush_first_fill_GBps"] / row["write_fsync_GBps"]
    row["flush_disk_only_vs_write_fsync"] = row["flush_disk_only_GBps"] / row["write_fsync_GBps"]
    return row


def _reads(path: Path, plain: Path, prompt, src, kind: str, repeats: int, stored: int) -> dict:
    """Fetches from RAM and from disk (page-cached, cold), and the plain reads
    of the same bytes, each kind back to back (alternating, each found the
    memory the other had just freed taken back by the VM's host)."""
    ts: dict[str, list[float]] = {}
    base: dict[str, list[float]] = {k: [] for k in ("read_cached", "read_cold", "read_cached_to_device",
                                                    "read_cold_to_device")}
    np.fromfile(plain, np.uint8)  # written pages settle before reads are timed
    for cold in (False, True):
        for _ in range(repeats):
            _plain_read(plain, cold, base)
    with PrefixStore(budget_gb=0, device_budget_gb=0, ssd_path=path, fetch_policy="always") as s:  # the fetch alone
        ts["fetch_ssd_cached"] = [_timed_fetch(s, prompt, src, kind, "ssd_tokens") for _ in range(repeats)]
    ts["fetch_ssd_cold"] = []
    priors: list[float] = []  # what fetch_policy="auto" assumes of a cold read before it has measured one
    probes: dict[str, list[float]] = {}  # the direct reads that prior is made from, by size and threads
    for _ in range(repeats):
        _drop(path)
        with PrefixStore(budget_gb=0, device_budget_gb=0, ssd_path=path, fetch_policy="always") as s:
            ts["fetch_ssd_cold"].append(_timed_fetch(s, prompt, src, kind, "ssd_tokens"))
        _drop(path)
        with PrefixStore(budget_gb=0, ssd_path=path, fetch_policy="auto", remember_rates=False) as s:
            cold = s.stats()["cost"]["rates"].get("ssd_cold")
            if cold:
                priors.append(cold["gb_per_s"])
        for mib, threads in ((64, 4), (256, 4), (256, 16)):
            _drop(path)
            rate = probe.direct_read_rate(path / "data.mdb", mib << 20, threads)
            if rate:
                probes.setdefault(f"{mib}MiB_{threads}threads", []).append(rate / 1e9)
    ts.update(_hot(path, prompt, src, kind, repeats, promoting=True))
    row: dict = {}
    for name, secs in base.items():
        if secs:
            row[f"{name}_GBps"] = _gbps(stored, secs)
    row.update(_fetch_figures(ts, stored))
    row["prior_ssd_cold_GBps"] = statistics.median(priors) if priors else None
    row["probe_cold_GBps"] = {k: statistics.median(v) for k, v in probes.items()}
    dev = "_to_device" if base["read_cached_to_device"] else ""
    row["ssd_cached_vs_read"] = row["fetch_ssd_cached_GBps"] / row[f"read_cached{dev}_GBps"]
    row["ssd_cold_vs_read"] = row["fetch_ssd_cold_GBps"] / row[f"read_cold{dev}_GBps"]
    return row


def _hot(path: Path, prompt, src, kind: str, repeats: int, promoting: bool) -> dict[str, list[float]]:
    """RAM hits, and on CUDA device-tier hits (the copies a first hit left in
    GPU memory); with ``promoting``, after each RAM hit a page-cached read by
    the same store, which copies the blocks into RAM on its writer thread
    meanwhile."""
    ts: dict[str, list[float]] = {"fetch_ram": []}
    if cuda.runtime() is not None:
        ts["fetch_device"] = []
        with PrefixStore(budget_gb=64, device_budget_gb=64, ssd_path=path, fetch_policy="always") as s:
            s.fetch("bench", prompt)
            s.flush()
            s.fetch("bench", prompt)
            for _ in range(repeats):
                ts["fetch_device"].append(_timed_fetch(s, prompt, src, kind, "ram_tokens"))
    if promoting:
        ts["fetch_ssd_cached_promoting"] = []
    with PrefixStore(budget_gb=64, device_budget_gb=0, ssd_path=path, fetch_policy="always") as s:
        s.fetch("bench", prompt)  # read once: warm and in RAM
        s.flush()
        for _ in range(repeats):
            ts["fetch_ram"].append(_timed_fetch(s, prompt, src, kind, "ram_tokens"))
            if promoting:
                s.trim_ram(0)
                ts["fetch_ssd_cached_promoting"].append(_timed_fetch(s, prompt, src, kind, "ssd_tokens"))
                s.flush()
    return ts


def _fetch_figures(ts: dict[str, list[float]], stored: int) -> dict:
    """Per kind of fetch: its median ms, GB/s of stored bytes and each time."""
    row: dict = {}
    for name, secs in ts.items():
        row[f"{name}_ms"] = statistics.median(secs) * 1e3
        row[f"{name}_GBps"] = _gbps(stored, secs)
        row[f"{name}_each_ms"] = [round(x * 1e3, 1) for x in secs]
    return row


def run(tokens: int, layers: int, heads: int, dim: int, kinds: list[str], repeats: int, tmp: Path,
        out: Path | None = None, parts: tuple[str, ...] = ("reads", "writes")) -> dict:
    """Per entry type: reads first (from a store written untimed, against a
    plain file of its size), then writes; ``parts`` picks them (``hot``: of
    the reads, RAM and device-tier hits only)."""
    src = _layers(tokens, layers, heads, dim)
    prompt = np.arange(5, tokens + 5, dtype=np.int32)
    res: dict = {"tokens": tokens, "shape": [layers, heads, dim], "device": str(mx.default_device()),
                 "mlx_cache_limit": _cache_limit(),
                 "cuda_copy_engine": cuda.runtime() is not None, "date": time.strftime("%Y-%m-%d %H:%M"),
                 "rows": []}
    plain = tmp / "plain.bin"
    for kind in kinds:
        path = tmp / f"store-{kind}"
        _fresh(path)
        with PrefixStore(budget_gb=0, ssd_path=path, kv_bits=KV[kind]) as s:
            s.put("bench", prompt, src)
            s.flush()
            stored = s.stats()["ssd_bytes"]
        _plain_write(plain, stored)
        row: dict = {"kv": kind, "stored_bytes": stored}
        if "reads" in parts:
            row.update(_reads(path, plain, prompt, src, kind, repeats, stored))
        elif "hot" in parts:  # (reads include them)
            row.update(_fetch_figures(_hot(path, prompt, src, kind, repeats, promoting=False), stored))
        if "writes" in parts:
            row.update(_writes(path, plain, prompt, src, kind, repeats))
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        if out is not None:  # row by row: a later row's failure keeps the earlier ones
            out.mkdir(parents=True, exist_ok=True)
            (out / "ssd.json").write_text(json.dumps(res, indent=1))
        _fresh(path)
        plain.unlink(missing_ok=True)
    return res


def add_shape_args(ap: argparse.ArgumentParser, tokens: int) -> None:
    """The KV set's options (Llama-3-8B's shape by default) and the entry types."""
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--kv", nargs="+", default=list(KV), choices=list(KV))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench ssd", description=__doc__.split("\n\n")[0])
    add_shape_args(ap, tokens=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="write ssd.json here")
    ap.add_argument("--parts", nargs="+", default=["reads", "writes"], choices=["reads", "writes", "hot"])
    ap.add_argument("--mlx-cache-gb", type=float, default=None,
                    help="mx.set_cache_limit first: how much freed memory mlx keeps for reuse (an engine setting)")
    args = ap.parse_args(argv)
    if args.mlx_cache_gb is not None:
        mx.set_cache_limit(int(args.mlx_cache_gb * (1 << 30)))
    tmp = Path(tempfile.mkdtemp(prefix="ssd-bench-", dir=args.dir))
    try:
        run(args.tokens, args.layers, args.heads, args.dim, args.kv, args.repeats, tmp, args.out, tuple(args.parts))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
