"""A store's LMDB file out of the OS page cache, for the live replay's ``--drop-page-cache``: its SSD
hits then read the disk, as on a machine whose page cache cannot hold the store.

LMDB maps its data file (``SSD_PATH/data.mdb``) whole and shared, and the kernel never evicts a page a
process has mapped: neither ``posix_fadvise(POSIX_FADV_DONTNEED)`` nor ``/proc/sys/vm/drop_caches``
drops a page that the store has read or written through its map. So a drop first takes this process's
page-table entries of the map away (``madvise(MADV_DONTNEED)``: on a shared file mapping the data stays
in the file and its page cache, a dirty page stays dirty, and the next touch faults the page in again),
then asks the kernel to drop the file's clean pages (``POSIX_FADV_DONTNEED``; it starts the write-out of
dirty ones, which stay: the writer's pages in flight), or (``method="drop_caches"``, root) writes 1 to
``/proc/sys/vm/drop_caches``: the whole machine's clean page cache, slower, and a fallback where fadvise
has no effect (it is an advice). What each drop found and left is measured with ``cachestat(2)`` (Linux
6.5: cached, dirty and under write-out), else ``mincore(2)`` on the map (``kvstore.tiers.disk.residency``;
no read, no dirty count). A page the store touches right after a drop comes back with the kernel's
read-around (``read_ahead_kb``: 128 KiB by default, 8 MiB on the CPU box): on a store of a few MiB (the
smoke trace's) that is most of the file, on the GPU trace's (GiBs, 32 MiB a block) a small share."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path
from typing import Any, Optional

from kvstore.tiers.disk.residency import map_base, resident_at

WORKED = 0.05  # at most this share of the file's pages left cached and clean, on average: the drops worked
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_CACHESTAT = 451  # cachestat(2), Linux 6.5 (one number on every architecture)
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):
    _libc = _madvise = None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def _cached(fd: int, span: Optional[tuple[int, int]], size: int) -> tuple[Optional[float], Optional[float]]:
    """(share of the file's pages in the page cache, share dirty or under write-out): ``cachestat(2)``
    where the kernel has it (no dirty share otherwise: ``mincore`` on the map)."""
    pages = max(1, -(-size // mmap.PAGESIZE))
    st = _Stat()
    if _libc is not None and _libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(st), 0) == 0:
        return min(1.0, st.cache / pages), min(1.0, (st.dirty + st.writeback) / pages)  # (a large folio past the end)
    return (resident_at(span[0], min(size, span[1] - span[0])) if span else None), None


def drop(ssd_path: Path, method: str = "fadvise") -> dict[str, Any]:
    """Drop the store's data file at ``ssd_path`` from the page cache, by ``method`` ("fadvise", or
    "drop_caches" where the process may write it, else fadvise): ``{"method", "bytes", "cached_before",
    "cached_after", "dirty_after", "clean_after", "s"}`` (the method used; shares of the file's pages:
    cached, dirty or being written (which no drop can take), cached and clean; None where unknown);
    method "none" where there is no file."""
    data = Path(ssd_path) / "data.mdb"
    if not data.exists():
        return {"method": "none", "bytes": 0, "s": 0.0}
    t = time.perf_counter()
    size = data.stat().st_size
    span = map_base(str(data))
    fd = os.open(data, os.O_RDONLY)
    try:
        before, _ = _cached(fd, span, size)
        if span is not None and _madvise is not None and hasattr(mmap, "MADV_DONTNEED"):
            _madvise(span[0], span[1] - span[0], mmap.MADV_DONTNEED)
        used = "fadvise"
        if method == "drop_caches" and os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK):
            try:
                DROP_CACHES.write_text("1")
                used = "drop_caches"
            except OSError:
                pass
        if used == "fadvise":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        after, dirty = _cached(fd, span, size)
    finally:
        os.close(fd)
    return {"method": used, "bytes": size, "cached_before": before, "cached_after": after, "dirty_after": dirty,
            "clean_after": None if after is None else max(0.0, after - (dirty or 0)), "s": time.perf_counter() - t}


def fs_type(path: Path) -> Optional[str]:
    """The type of the file system ``path`` lies on (``/proc/mounts``; None elsewhere): a store on
    ``tmpfs`` lives in the page cache, which no drop can take."""
    real, best = os.path.realpath(path), ("", None)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, point, kind = line.split()[:3]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                    best = (point, kind)
    except OSError:
        return None
    return best[1]


def _mean(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(drops: list[dict]) -> dict[str, Any]:
    """A round's drops in a few figures: how many, by which method, means of the file's cached share
    before and after, its dirty share after (pages being written, which stay) and its share left
    cached and clean (a page faulted in again at once, with the kernel's read-around, by the writer
    between the drop and the count: on a file of a few MiB, most of it), whether that mean is at most
    ``WORKED`` (``worked``), and the seconds they took."""
    made = [d for d in drops if d["method"] != "none"]
    methods: dict[str, int] = {}
    for d in made:
        methods[d["method"]] = methods.get(d["method"], 0) + 1
    out = {k + "_mean": _mean([d[k] for d in made]) for k in ("cached_before", "cached_after", "dirty_after",
                                                                "clean_after")}
    clean = out["clean_after_mean"]
    return {"drops": len(made), "methods": methods, **out, "worked": clean is not None and clean <= WORKED,
            "seconds": sum(d["s"] for d in drops)}
