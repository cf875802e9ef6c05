"""The CUDA runtime calls mlx does not expose, for moving KV between host and GPU.

mlx's CUDA backend has no host->device copy of its own. What its kernels
make lives in device memory until its address is first taken (the buffer
protocol, as ``np.asarray`` uses it): mlx then moves it into managed memory
(``cudaMallocManaged``) with a copy, which costs about as much as the
transfer itself, and the host sees it there; a host-filled array reaches the
GPU by page faults when a kernel first reads it, far below the bus. The copy
engine is what moves bytes at the bus (``cudaMemcpyAsync`` from pinned host
memory), so hits land in a buffer whose address was taken once and is
reused (``landing``); ``cudaMemPrefetchAsync`` of managed pages is slow too,
so it serves background moves (promotion) alone. Figures:
docs/benchmarks.md, "The hot path at the bus". This module finds the runtime
mlx already loaded (the library mapped into the process, so the context is
mlx's own) and calls it through ctypes; ``runtime()`` is ``None`` wherever
there is no CUDA (the CPU, Apple silicon), and callers then do nothing.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

_HOST = -1  # cudaCpuDeviceId


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # cudaMemLocation


class Runtime:
    """The few CUDA runtime calls the store makes, on the library mlx uses."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        v = ctypes.c_int(0)
        self._check(lib.cudaRuntimeGetVersion(ctypes.byref(v)), "cudaRuntimeGetVersion")
        self.version = v.value
        dev = ctypes.c_int(0)
        self._check(lib.cudaGetDevice(ctypes.byref(dev)), "cudaGetDevice")
        self.device = dev.value
        lib.cudaMemPrefetchAsync.restype = ctypes.c_int
        if self.version >= 13000:  # (ptr, count, cudaMemLocation, flags, stream)
            lib.cudaMemPrefetchAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _Location, ctypes.c_uint,
                                                 ctypes.c_void_p]
        else:  # (ptr, count, device, stream)
            lib.cudaMemPrefetchAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        attr = ctypes.c_int(0)
        lib.cudaDeviceGetAttribute(ctypes.byref(attr), 89, self.device)  # cudaDevAttrConcurrentManagedAccess
        self.concurrent_managed = bool(attr.value)

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed with CUDA error {err}")

    def prefetch(self, ptr: int, nbytes: int, to_device: bool) -> None:
        """Start moving ``[ptr, ptr + nbytes)`` of managed memory to the GPU
        (or back to the host); ``sync()`` waits for every move started."""
        if nbytes <= 0 or not self.concurrent_managed:
            return
        dst = self.device if to_device else _HOST
        if self.version >= 13000:
            loc = _Location(1 if to_device else 2, dst if to_device else 0)  # Device / Host
            err = self.lib.cudaMemPrefetchAsync(ptr, nbytes, loc, 0, None)
        else:
            err = self.lib.cudaMemPrefetchAsync(ptr, nbytes, dst, None)
        self._check(err, "cudaMemPrefetchAsync")

    def sync(self, stream=None) -> None:
        self._check(self.lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def copy(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        """Copy ``nbytes`` between any two addresses (the copy engine; async
        on ``stream`` when the host side is pinned, else it returns when done)."""
        if nbytes > 0:
            self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, 4, stream), "cudaMemcpyAsync")  # Default

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream=None) -> None:
        """Copy ``height`` lines of ``width`` bytes, ``spitch`` apart at ``src``
        to ``dpitch`` apart at ``dst`` (one strided copy on the copy engine)."""
        if width > 0 and height > 0:
            err = self.lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, 4, stream)
            self._check(err, "cudaMemcpy2DAsync")

    def total_memory(self) -> int:
        """Bytes of the GPU's memory."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._check(self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return total.value

    def stream(self):
        s = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreate")  # non-blocking
        return s

    def pinned(self, nbytes: int, tally: Optional[list] = None) -> np.ndarray:
        """Page-locked host memory as a byte array, freed once no array or
        view over it is left; ``tally[0]`` counts its bytes while it lives."""
        return np.asarray(_Pinned(self, nbytes, tally))


class _Pinned:
    """Page-locked host bytes (``cudaHostAlloc``): the copy engine moves them
    to and from the GPU without a staging copy. Numpy arrays made from it
    keep it alive; the last one to go frees it."""

    _count = threading.RLock()  # (re-entrant: a collection may free one while this thread counts)

    def __init__(self, rt: Runtime, nbytes: int, tally: Optional[list] = None):
        p = ctypes.c_void_p()
        rt._check(rt.lib.cudaHostAlloc(ctypes.byref(p), max(1, nbytes), 0), "cudaHostAlloc")
        self._free, self.ptr = rt.lib.cudaFreeHost, p.value
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (p.value, False), "version": 3}
        self._tally = _counted(tally, nbytes)

    def __del__(self):
        try:
            self._free(self.ptr)
            _counted(self._tally, -self.__array_interface__["shape"][0])
        except Exception:  # (an interpreter shutting down)
            pass


def _counted(tally: Optional[list], nbytes: int) -> Optional[list]:
    """Add ``nbytes`` to ``tally[0]`` (the bytes a caller's page-locked buffers hold now); ``tally``."""
    if tally is not None:
        with _Pinned._count:
            tally[0] += nbytes
    return tally


class Carved:
    """Bytes ``[offset, offset + nbytes)`` of a page-locked arena, as an
    array of their own (its base is this, not the arena: a buffer handed
    back is this part, never the whole arena); keeps the arena alive."""

    def __init__(self, arena: np.ndarray, offset: int, nbytes: int):
        self.arena = arena
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (arena.ctypes.data + offset, False), "version": 3}


def is_pinned(buf) -> bool:
    """Whether ``buf`` (an array or memoryview, or a view of one) lies in
    page-locked memory this module allocated."""
    for _ in range(16):
        if isinstance(buf, Carved):
            buf = buf.arena
        if isinstance(buf, _Pinned):
            return True
        buf = buf.obj if isinstance(buf, memoryview) else buf.base if isinstance(buf, np.ndarray) else None
        if buf is None:
            return False
    return False


_lock = threading.Lock()
_runtime: Optional[Runtime] = None
_probed = False


def runtime() -> Optional[Runtime]:
    """The CUDA runtime mlx runs on, or None (no CUDA, or ``KVSTORE_NO_PREFETCH=1``)."""
    global _runtime, _probed
    if _probed:
        return _runtime
    with _lock:
        if not _probed:
            _runtime = _find()
            _probed = True
    return _runtime


def _find() -> Optional[Runtime]:
    if os.environ.get("KVSTORE_NO_PREFETCH") == "1":
        return None
    try:
        if not mx.cuda.is_available():
            return None
    except AttributeError:
        return None
    for path in _loaded_cudart() + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return Runtime(ctypes.CDLL(path))
        except (OSError, AttributeError, RuntimeError):
            continue
    return None


def _loaded_cudart() -> list[str]:
    """Paths of the CUDA runtime libraries already mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        return []


STAGE = 16 << 20  # bytes per pinned staging buffer (two per transfer in flight)
_stages: "queue.SimpleQueue" = queue.SimpleQueue()  # (stream, [buffer, buffer]) not in use


@contextmanager
def _staging(rt: Runtime) -> Iterator[tuple]:
    """A stream and two pinned buffers from a process-wide pool: made when
    none is free, kept for reuse (pinned memory is slow to get and never
    returned to the OS), so there are only as many as transfers ever ran at
    once, however many threads and stores come and go."""
    try:
        st = _stages.get_nowait()
    except queue.Empty:
        st = (rt.stream(), [rt.pinned(STAGE), rt.pinned(STAGE)])
    try:
        yield st
    finally:
        try:
            rt.sync(st[0])  # nothing in flight into its buffers when the next user takes them
        finally:
            _stages.put(st)


LANDING = 1 << 30  # bytes of GPU memory a hit's host blocks land in at most at once (held for the process)
_landing: "queue.SimpleQueue" = queue.SimpleQueue()  # landing buffers not in use


@contextmanager
def landing(nbytes: int) -> Iterator[tuple[mx.array, int]]:
    """A GPU buffer of at least ``nbytes`` (uint8) for the copy engine to
    write into, and its address. mlx keeps what its kernels make in device
    memory and moves a buffer into managed memory, with a copy, the first
    time its address is taken (as slow as the transfer), so landing
    buffers are made once and reused, as many as hits ran at once."""
    try:
        buf, addr = _landing.get_nowait()
    except queue.Empty:
        buf = addr = None
    if buf is None or buf.size < nbytes:
        buf = mx.zeros((max(nbytes, min(LANDING, 256 << 20 if buf is None else 2 * buf.size)),), mx.uint8)
        mx.eval(buf)
        addr = address(buf)
    yield buf, addr
    _landing.put((buf, addr))  # not after an error: a copy could still be landing in it


def upload(rt: Runtime, dst: int, src: memoryview) -> None:
    """Host bytes to device address ``dst``: from pinned memory in one copy
    on the copy engine; from pageable memory through alternating pinned
    buffers, each copy into one overlapping the transfer of the other."""
    if is_pinned(src):
        upload_pinned(rt, [(dst, src)])
        return
    upload_lines(rt, src, 1, lambda at, first, n, stream: rt.copy(dst + first, at, n, stream))  # lines of a byte


def upload_pinned(rt: Runtime, moves: list[tuple[int, memoryview]]) -> None:
    """Pinned host bytes to device addresses, ``(dst, src)`` each: all queued
    on one stream back to back, then one wait (the copy engine never idles
    between blocks, as it would behind a wait per block)."""
    with one_stream(rt) as stream:
        for dst, src in moves:
            a = np.frombuffer(src, np.uint8)
            rt.copy(dst, a.ctypes.data, len(a), stream)


@contextmanager
def staged(rt: Runtime, src: memoryview) -> Iterator[tuple[int, object]]:
    """Pageable host bytes (at most ``STAGE``) copied into a pinned staging
    buffer: its address and a stream for the copies out of it, all done when
    the block ends."""
    with _staging(rt) as (stream, bufs):
        a = np.frombuffer(src, np.uint8)
        np.copyto(bufs[0][: len(a)], a)
        yield bufs[0].ctypes.data, stream


@contextmanager
def one_stream(rt: Runtime) -> Iterator[object]:
    """A stream from the pool; everything queued on it is done when the block ends."""
    with _staging(rt) as (stream, _):
        yield stream


def upload_lines(rt: Runtime, src: memoryview, pitch: int, send: Callable[[int, int, int, object], None]) -> None:
    """Pageable host lines of ``pitch`` bytes (``src``) through alternating
    pinned buffers: ``send(address, first, count, stream)`` queues the copy
    of lines ``[first, first + count)``, staged at ``address``, on ``stream``."""
    src = np.frombuffer(src, np.uint8)
    per = max(1, STAGE // pitch)
    with _staging(rt) as (stream, bufs):
        pending = [False, False]
        for j, first in enumerate(range(0, len(src) // pitch, per)):
            k = j % 2
            if pending[k]:
                rt.sync(stream)  # the transfer that used this buffer is done
                pending = [False, False]
            part = src[first * pitch : (first + per) * pitch]
            np.copyto(bufs[k][: len(part)], part)
            send(bufs[k].ctypes.data, first, len(part) // pitch, stream)
            pending[k] = True


def download(rt: Runtime, dst: np.ndarray, src: int, hasher=None) -> None:
    """Device bytes at ``src`` into host array ``dst`` (uint8): the copy
    engine fills one pinned buffer while the host empties the other (and
    feeds ``hasher``, in order, while the bytes are in its cache)."""
    chunks = [(off, min(STAGE, len(dst) - off)) for off in range(0, len(dst), STAGE)]
    if is_pinned(dst):
        with _staging(rt) as (stream, _):  # straight into ``dst``; the next chunk lands while one is hashed
            base = dst.ctypes.data
            for j, (off, n) in enumerate(chunks):
                if j == 0:
                    rt.copy(base, src, n, stream)
                rt.sync(stream)
                if j + 1 < len(chunks):
                    o, m = chunks[j + 1]
                    rt.copy(base + o, src + o, m, stream)
                if hasher is not None:
                    hasher.update(dst[off : off + n])
        return
    with _staging(rt) as (stream, bufs):
        for j, (off, n) in enumerate(chunks):
            if j == 0:
                rt.copy(bufs[0].ctypes.data, src, n, stream)
            rt.sync(stream)  # chunk j has landed
            if j + 1 < len(chunks):
                o, m = chunks[j + 1]
                rt.copy(bufs[(j + 1) % 2].ctypes.data, src + o, m, stream)
            np.copyto(dst[off : off + n], bufs[j % 2][:n])
            if hasher is not None:
                hasher.update(bufs[j % 2][:n])


def address(a: mx.array) -> int:
    """Where an evaluated array's data starts: in managed memory, where mlx
    moves a device buffer the first time (see the module docstring)."""
    return np.asarray(a).__array_interface__["data"][0] if a.size else 0


def to_device(arrays: list[mx.array]) -> None:
    """Move host-filled arrays to the GPU in bulk before a kernel faults them in."""
    _prefetch(arrays, True)


def _prefetch(arrays: list[mx.array], to_device: bool) -> None:
    rt = runtime()
    if rt is None or not arrays:
        return
    for a in arrays:
        rt.prefetch(address(a), a.nbytes, to_device)
    rt.sync()
