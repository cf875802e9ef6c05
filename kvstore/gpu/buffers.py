"""Host memory for blocks' bytes, used again once nothing refers to it.

A fresh buffer costs its page faults (docs/design-notes.md, "buffers"), and
a store in its steady state lets go of blocks' bytes about as fast as it
makes new ones (a block written through with no room in RAM, a block
evicted from a full RAM tier), so those buffers are handed back here and
taken again. On CUDA they are page-locked (``cuda.Runtime.pinned``): the
RAM tier's blocks then reach the GPU on the copy engine in one copy, and
blocks written from the GPU land in them the same way.

A buffer handed back is reused only when Python holds no other reference to
it: every slice, memoryview and exported buffer of a numpy array holds one,
so a fetch still copying out of an evicted block, or a write still putting
it, keeps it from being reused. At most ``_KEEP`` bytes wait here.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import deque

import numpy as np

from . import cuda

log = logging.getLogger("kvstore")

_KEEP = 640 << 20  # bytes of handed-back buffers kept for reuse: a write transaction's worth, and more
_MIN = 1 << 20  # smaller buffers come and go through numpy's own cache
_SLACK = 256 << 20  # page-locked bytes past the stores' budgets (``_pinned_cap``)

_lock = threading.Lock()
_waiting: "deque[np.ndarray]" = deque()
_waiting_bytes = 0
_reserved: dict[int, int] = {}  # id(owner) -> bytes it asked to keep (``reserve``)
_arenas: dict[int, list] = {}  # id(owner) -> [page-locked arena made at open, bytes carved from it] (``prefill``)
_PAGE = 4096
_pinned = [0]  # bytes of page-locked buffers and arenas made here that are alive now
made = [0, 0.0, 0]  # page-locked bytes this process made outside an arena, the seconds that took, pageable bytes
# made past the cap (``_pinned_cap``)
_released: "deque[int]" = deque()  # owners gone without saying so (``_release``)


def take(n: int, new_pinned: bool = True) -> np.ndarray:
    """A writable uint8 array of at least ``n`` bytes (from a handed-back
    buffer no longer referred to, when one fits). ``new_pinned=False``: on
    CUDA, a new buffer is pageable, for a caller the GPU must not wait on
    (making page-locked memory holds up its kernels: ``reserve``)."""
    if n >= _MIN:
        with _lock:
            raw = _reusable(n, n + n // 8)
        if raw is not None:
            return raw
    rt = cuda.runtime() if n >= _MIN and new_pinned else None
    if rt is not None:
        with _lock:
            carved = _carve(n)
            if carved is None and _pinned[0] + n > _pinned_cap():
                # a larger page-locked buffer rather than a pageable one
                carved = _reusable(n, 2 * n, pinned_only=True)
                if carved is None:
                    made[2] += n
                    rt = None
        if carved is not None:
            return carved
    if rt is not None:
        t0 = time.perf_counter()
        raw = rt.pinned(n, _pinned)
        with _lock:
            made[0] += n
            made[1] += time.perf_counter() - t0
        return raw
    return np.empty(n, np.uint8)


def _pinned_cap() -> int:
    """Page-locked bytes a process holds at most: its stores' RAM budgets and a
    quarter more for blocks on their way. Past it a new buffer is pageable
    (a copy from it is staged): making and freeing page-locked memory holds
    up the engine's kernels, and in a store smaller than its traffic, a cap
    is what keeps it from making and freeing its budget over and over. Lock held."""
    total = sum(_reserved.values())
    return total + total // 4 + _SLACK


def _reusable(lo: int, hi: int, pinned_only: bool = False) -> "np.ndarray | None":
    """A handed-back buffer of ``lo`` to ``hi`` bytes that nothing else refers to, taken out. Lock held."""
    global _waiting_bytes
    for i in range(len(_waiting)):
        # references: ``_waiting``'s and getrefcount's argument
        if lo <= _waiting[i].nbytes <= hi and sys.getrefcount(_waiting[i]) <= 2:
            if not pinned_only or cuda.is_pinned(_waiting[i]):
                raw = _waiting[i]
                del _waiting[i]
                _waiting_bytes -= raw.nbytes
                return raw
    return None


def prefill(owner: object, nbytes: int) -> float:
    """On CUDA, make ``nbytes`` of page-locked memory now, for ``owner``'s
    next new buffers: a store's first fill would otherwise make them while
    the engine runs, holding up its kernels (``reserve``). Seconds it took
    (0 elsewhere). Dropped with ``reserve(owner, 0)``; parts still in use
    keep the memory until they go."""
    rt = cuda.runtime()
    if rt is None or nbytes < _MIN:
        return 0.0
    t0 = time.perf_counter()
    arena = rt.pinned(int(nbytes), _pinned)
    with _lock:
        _arenas[id(owner)] = [arena, 0]
    seconds = time.perf_counter() - t0
    log.info("kvstore: made %.2f GiB of page-locked memory for the RAM tier in %.2f s", nbytes / (1 << 30), seconds)
    return seconds


def _carve(n: int) -> "np.ndarray | None":
    """``n`` bytes from an arena with room left (page-aligned), or None. Lock held."""
    for spot in _arenas.values():
        arena, used = spot
        if used + n <= arena.nbytes:
            spot[1] = used + (n + _PAGE - 1) // _PAGE * _PAGE
            return np.asarray(cuda.Carved(arena, used, n))
    return None


def give_back(view) -> None:
    """Offer the memory behind ``view`` (a memoryview or array of a buffer
    from ``take``) for reuse once its last other reference is gone."""
    global _waiting_bytes
    raw = view.obj if isinstance(view, memoryview) else view
    while isinstance(raw, np.ndarray) and isinstance(raw.base, np.ndarray):
        raw = raw.base
    if not isinstance(raw, np.ndarray) or raw.nbytes < _MIN or raw.dtype != np.uint8 or raw.ndim != 1:
        return
    with _lock:
        if any(w is raw for w in _waiting):
            return
        _waiting.append(raw)
        _waiting_bytes += raw.nbytes
        _trim()


def reserve(owner: object, nbytes: int) -> None:
    """Keep up to ``nbytes`` of handed-back buffers for ``owner`` (0: none
    more). On CUDA the buffers are page-locked: making one takes about 0.4 s
    per GiB, and freeing one holds up the whole GPU, the engine's kernels
    included, for about 0.1 s per GiB (H200; docs/design-notes.md). So a
    store keeps what its RAM tier lets go of, up to its budget, for its next
    blocks, and frees it when it closes, not while the engine waits."""
    with _lock:
        _drain()  # (first: an owner gone may have had this one's id)
        if nbytes > 0:
            if id(owner) not in _reserved:
                weakref.finalize(owner, _release, id(owner))  # (an owner never closed)
            _reserved[id(owner)] = int(nbytes)
        else:
            _reserved.pop(id(owner), None)
            _arenas.pop(id(owner), None)
        _trim()


def _release(owner_id: int) -> None:
    """An owner gone without ``reserve(owner, 0)``. Called by a finalizer, which may run in a garbage
    collection on a thread holding ``_lock``: it only notes the id (the next ``_drain`` drops it)."""
    _released.append(owner_id)


def _drain() -> None:
    while _released:
        gone = _released.popleft()
        _reserved.pop(gone, None)
        _arenas.pop(gone, None)


def _trim() -> None:
    global _waiting_bytes
    _drain()
    if _waiting_bytes <= _KEEP:
        return
    if cuda.runtime() is None:
        while _waiting_bytes > _KEEP:
            _waiting_bytes -= _waiting.popleft().nbytes
        return
    # page-locked buffers stay (the cap bounds them); pageable ones go first, oldest first
    kept: "deque[np.ndarray]" = deque()
    for raw in _waiting:
        if _waiting_bytes > _KEEP and not cuda.is_pinned(raw):
            _waiting_bytes -= raw.nbytes
        else:
            kept.append(raw)
    _waiting.clear()
    _waiting.extend(kept)
    keep = max(_KEEP, _pinned_cap())
    while _waiting_bytes > keep:
        _waiting_bytes -= _waiting.popleft().nbytes
