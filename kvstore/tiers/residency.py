"""How much of a mapped buffer is in the page cache (``mincore(2)``): a
page-cached read and a cold one differ several-fold, and the cost model
needs to know which it faces."""

from __future__ import annotations

import ctypes
import mmap
from typing import Optional

import numpy as np

_PAGE = mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _mincore = _libc.mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
except (OSError, AttributeError):
    _mincore = None


def resident_fraction(buf) -> Optional[float]:
    """mincore(2) over the mapped pages of ``buf`` (a view of LMDB's map)."""
    if _mincore is None or len(buf) == 0:
        return None
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    start = addr - addr % _PAGE
    length = addr + len(buf) - start
    pages = -(-length // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _mincore(start, length, vec) != 0:
        return None
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / pages
