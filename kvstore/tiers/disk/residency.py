"""How much of a stored value is in the page cache (``mincore(2)``): a
page-cached read and a cold one differ several-fold, and the cost model
needs to know which it faces.

The check must not read the value. py-lmdb's ``get`` touches every page of a
value before returning it (``preload``: page faults then happen without the
GIL), so asking LMDB for a value to ``mincore`` it read the whole block from
disk, and every block looked cached. Instead the writer records where each
value's bytes sit in the file (``BlockRecord.offset``; LMDB never moves an
unchanged value), and the check finds LMDB's mapping of the file in
``/proc/self/maps`` and asks ``mincore`` about that range: no I/O. Where
there is no ``/proc`` (macOS) or no offset (values written before offsets
were recorded, or without ``writemap``), residency is unknown.

The writer uses the same offsets the other way: it puts the page cache of
the pages LMDB is about to write in place beforehand (``prefill``), and
starts a value's write-out as soon as it is in the map
(``start_writeback``), so the disk writes one value while the next is copied
instead of all of them in the commit's sync.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np

_PAGE = mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _mincore = _libc.mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
except (OSError, AttributeError):
    _mincore = None
try:
    _madvise = _libc.madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (NameError, AttributeError):
    _madvise = None
try:
    _sync_file_range = _libc.sync_file_range  # Linux
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
except (NameError, AttributeError):
    _sync_file_range = None
_SYNC_FILE_RANGE_WRITE = 2


def address(buf) -> int:
    """Where a buffer's bytes start (no copy, no read)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


def view_at(addr: int, nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` of mapped memory at ``addr``; touching
    it reads its pages (the caller keeps the mapping alive and in range)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B").toreadonly()


def map_base(path: str) -> Optional[tuple[int, int]]:
    """``(start, end)`` of this process's mapping of ``path`` from file
    offset 0 (LMDB maps its data file once, whole), or ``None``."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].strip() == real and int(parts[2], 16) == 0:
                    lo, hi = parts[0].split("-")
                    return int(lo, 16), int(hi, 16)
    except (OSError, ValueError):
        return None
    return None


@contextmanager
def without_read_around(span: Optional[tuple[int, int]]) -> Iterator[None]:
    """While the block runs, a page fault in the mapping ``span`` reads its
    own page only (``MADV_RANDOM``), not the kernel's read-around window
    about it (``read_ahead_kb``, megabytes on some machines): reading the
    index at open faults in its pages, which lie among blocks' values, and
    with read-around it read a good share of a store's blocks that nobody
    asked for (docs/design-notes.md)."""
    advise = _madvise if span is not None and hasattr(mmap, "MADV_RANDOM") else None
    if advise is not None:
        advise(span[0], span[1] - span[0], mmap.MADV_RANDOM)
    try:
        yield
    finally:
        if advise is not None:
            advise(span[0], span[1] - span[0], mmap.MADV_NORMAL)


def resident_at(addr: int, nbytes: int) -> Optional[float]:
    """Fraction of the pages of ``[addr, addr + nbytes)`` (mapped) in the page cache."""
    if _mincore is None or nbytes <= 0:
        return None
    start = addr - addr % _PAGE
    length = addr + nbytes - start
    pages = -(-length // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _mincore(start, length, vec) != 0:
        return None
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / pages


def can_start_writeback() -> bool:
    return _sync_file_range is not None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing the dirty pages of ``[offset, offset + nbytes)`` of a
    file to disk, without waiting for them (``sync_file_range(2)``, Linux).
    Durability is unchanged: the commit's sync still waits for every page.
    Why: LMDB's commit syncs all of a transaction's pages at its end, so the
    disk idled while values were copied into the map; this way it writes one
    while the next is copied (docs/design-notes.md, "LMDB tier")."""
    if _sync_file_range is not None and nbytes > 0:
        start = offset - offset % _PAGE
        _sync_file_range(fd, start, offset + nbytes - start, _SYNC_FILE_RANGE_WRITE)  # advice: errors ignored


_ZEROS = bytes(8 << 20)


def prefill(fd: int, offset: int, nbytes: int) -> None:
    """Write zeros over ``[offset, offset + nbytes)`` of a file whose bytes
    there are unused (an allocated file's unwritten end): its page cache is
    then in place, in large folios and already dirty, when a copy into the
    mapping of those pages follows, which otherwise takes a write fault per
    4 KiB page; the commit's sync of large folios is faster too
    (docs/design-notes.md, "LMDB tier")."""
    end = offset + nbytes
    while offset < end:
        offset += os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - offset)], offset)
