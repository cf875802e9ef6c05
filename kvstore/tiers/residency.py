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
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

import numpy as np

_PAGE = mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _mincore = _libc.mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
except (OSError, AttributeError):
    _mincore = None


def address(buf) -> int:
    """Where a buffer's bytes start (no copy, no read)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


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
