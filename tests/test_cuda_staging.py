"""The staged transfers of ``kvstore.cuda`` (pinned buffers, two in turn per
transfer, from a process-wide pool), driven through a runtime whose copy
engine is ``memmove`` on host memory: the chunking and the pool are the same
code the CUDA runtime runs (the copies themselves need a GPU)."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from kvstore import cuda


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
