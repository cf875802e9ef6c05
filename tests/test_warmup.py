"""A store opening on CUDA pays what a process's first hits would (the
landing buffer at its full size, pinned staging buffers, the codec's
kernels), once per process and codec; elsewhere it does nothing."""

from __future__ import annotations

import pytest

from kvstore.gpu import cuda
from kvstore.config import StoreConfig
from kvstore.store import PrefixStore
from kvstore.warmup import warm_device

from ._helpers import M, assert_hit_is, put, toks

needs_cuda = pytest.mark.skipif(cuda.runtime() is None, reason="needs mlx's CUDA backend")


def test_without_cuda_nothing_is_warmed():
    if cuda.runtime() is not None:
        pytest.skip("on CUDA")
    assert warm_device(StoreConfig(kv_bits=4), PrefixStore) == 0.0


@needs_cuda
def test_a_store_opening_on_cuda_makes_the_landing_buffer_whole_once_per_codec():
    s = PrefixStore(budget_gb=0.5, block_size=96)  # settings no other test warms; dense fp16 lands in one buffer
    landing = [cuda._landing.get_nowait() for _ in range(cuda._landing.qsize())]
    for b in landing:
        cuda._landing.put(b)
    assert any(buf.size >= cuda.LANDING for buf, _ in landing)
    assert warm_device(s.config, PrefixStore) == 0.0  # once per process and codec
    p = toks(600)
    put(s, p)
    s.flush()
    before = cuda._landing.qsize()
    assert_hit_is(s.fetch(M, p), p, 600)
    assert cuda._landing.qsize() == before  # the hit used a buffer made at open, made none of its own
    s.close()
