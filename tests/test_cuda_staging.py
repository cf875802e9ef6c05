"""The staged transfers of ``kvstore.gpu.cuda`` (pinned buffers, two in turn per
transfer, from a process-wide pool), driven through a runtime whose copy
engine is ``memmove`` on host memory: the chunking and the pool are the same
code the CUDA runtime runs (the copies themselves need a GPU)."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from kvstore.gpu import cuda


class HostRuntime:
    """The four calls ``upload``/``download`` make, on host memory."""

    def __init__(self):
        self.streams = 0
        self.pinned_bytes = 0

    def stream(self):
        self.streams += 1
        return self.streams

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_bytes += nbytes
        return np.empty(nbytes, np.uint8)

    def copy(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        ctypes.memmove(dst, src, nbytes)

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream=None) -> None:
        for i in range(height):
            ctypes.memmove(dst + i * dpitch, src + i * spitch, width)

    def sync(self, stream=None) -> None:
        pass


def _drain_pool() -> None:
    while not cuda._stages.empty():
        cuda._stages.get_nowait()


def test_upload_and_download_move_every_byte_across_chunk_boundaries():
    _drain_pool()
    rt = HostRuntime()
    src = np.random.default_rng(0).integers(0, 256, 2 * cuda.STAGE + 12345, dtype=np.uint8)
    dev = np.zeros_like(src)
    cuda.upload(rt, dev.ctypes.data, memoryview(src))
    assert np.array_equal(dev, src)
    back = np.zeros_like(src)
    cuda.download(rt, back, dev.ctypes.data)
    assert np.array_equal(back, src)


def test_staging_buffers_are_reused_not_made_per_thread_or_call():
    """Pinned memory is made only for transfers running at once: sequential
    transfers from many threads share one pair of buffers."""
    _drain_pool()
    rt = HostRuntime()
    src = np.arange(3 * cuda.STAGE // 2, dtype=np.uint8)
    dev = np.zeros_like(src)

    def one():
        cuda.upload(rt, dev.ctypes.data, memoryview(src))

    for _ in range(4):
        t = threading.Thread(target=one)
        t.start()
        t.join()
    assert rt.streams == 1 and rt.pinned_bytes == 2 * cuda.STAGE
    assert np.array_equal(dev, src)


class _HostLib:
    """``cudaHostAlloc``/``cudaFreeHost`` on the C heap, counting both."""

    def __init__(self):
        self._libc = ctypes.CDLL(None)
        self._libc.malloc.restype = ctypes.c_void_p
        self._libc.free.argtypes = [ctypes.c_void_p]
        self.freed = self.made = 0

    def cudaHostAlloc(self, ptr, nbytes, flags):
        self.made += 1
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))[0] = self._libc.malloc(nbytes)
        return 0

    def cudaFreeHost(self, p):
        self.freed += 1
        self._libc.free(p)


class PinnedHostRuntime(HostRuntime):
    """A runtime whose page-locked memory is ``kvstore.gpu.cuda``'s own, on the heap."""

    def __init__(self):
        super().__init__()
        self.lib = _HostLib()
        self.copies = 0

    _check = staticmethod(cuda.Runtime._check)
    pinned = cuda.Runtime.pinned

    def copy(self, dst, src, nbytes, stream=None):
        self.copies += 1
        super().copy(dst, src, nbytes, stream)

    def copy2d(self, dst, dpitch, src, spitch, width, height, stream=None):
        self.copies += 1
        super().copy2d(dst, dpitch, src, spitch, width, height, stream)


def test_pinned_memory_moves_in_place_and_is_freed_with_its_last_view():
    """Bytes in page-locked memory (the RAM tier's blocks on CUDA) go to the
    device in one copy, with no staging copy; a download into it lands in
    place, hashed on the way like a staged one; the memory is freed once
    the last array or view over it is gone."""
    import xxhash

    _drain_pool()
    rt = PinnedHostRuntime()
    n = 2 * cuda.STAGE + 777
    buf = rt.pinned(n)
    buf[:] = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    view = memoryview(buf[64:])  # a block's payload: a view of a view
    view_ro = memoryview(np.frombuffer(view, np.uint8))
    assert cuda.is_pinned(view) and cuda.is_pinned(view_ro) and not cuda.is_pinned(memoryview(bytes(8)))
    dev = np.zeros(n - 64, np.uint8)
    cuda.upload(rt, dev.ctypes.data, view_ro)
    assert rt.copies == 1 and np.array_equal(dev, buf[64:])
    back = rt.pinned(n - 64)
    h = xxhash.xxh3_64()
    before = rt.copies
    cuda.download(rt, back, dev.ctypes.data, h)
    assert rt.copies - before == 3 and np.array_equal(back, dev)  # one per chunk, no staging
    assert h.intdigest() == xxhash.xxh3_64_intdigest(dev)
    del buf, back, view
    assert rt.lib.freed == 1  # ``back``; ``buf`` is still under view_ro
    del view_ro
    assert rt.lib.freed == 2


def test_a_remote_read_never_makes_page_locked_memory_but_reuses_what_the_ram_tier_left(monkeypatch):
    """Making page-locked memory holds up the whole GPU, so a payload read while the engine runs
    (``tiers/resp``) takes a handed-back page-locked buffer when one is free and a pageable one
    otherwise; the RAM tier's own blocks are still made page-locked."""
    from kvstore.gpu import buffers

    _drain_pool()
    rt = PinnedHostRuntime()
    monkeypatch.setattr(cuda, "runtime", lambda: rt)
    n = 3 << 20
    assert not cuda.is_pinned(buffers.take(n, new_pinned=False)) and rt.lib.made == 0
    block = buffers.take(n)  # a RAM-tier block
    assert cuda.is_pinned(block) and rt.lib.made == 1
    buffers.give_back(block)
    del block
    again = buffers.take(n, new_pinned=False)
    assert cuda.is_pinned(again) and rt.lib.made == 1  # the same memory, reused
