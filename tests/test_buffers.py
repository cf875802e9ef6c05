"""Blocks' host buffers are used again, and only once nothing refers to them."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.gpu import buffers, cuda
from kvstore.blocks.codec import Block
from kvstore.blocks.hashing import as_tokens
from kvstore.blocks.wire import serialize

from ._helpers import kv_layers

MiB = 1 << 20


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    """An empty pool, and no reservation or arena of stores other tests left open (on CUDA they count)."""
    monkeypatch.setattr(buffers, "_reserved", {})
    monkeypatch.setattr(buffers, "_arenas", {})
    monkeypatch.setattr(buffers, "_pinned", [0])  # (buffers of other tests count in the list they were made with)
    buffers._waiting.clear()
    buffers._waiting_bytes = 0
    yield
    buffers._waiting.clear()
    buffers._waiting_bytes = 0


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    raw = buffers.take(4 * MiB)
    where = raw.ctypes.data
    view = raw[64 : 64 + 3 * MiB]
    mv = memoryview(view)
    buffers.give_back(mv)
    del raw, view
    assert buffers.take(4 * MiB).ctypes.data != where  # a memoryview of a slice of it is still alive
    del mv
    again = buffers.take(4 * MiB)
    assert again.ctypes.data == where and again.nbytes == 4 * MiB
    assert buffers._waiting_bytes == 0


def test_only_a_buffer_of_about_the_size_asked_is_reused():
    buffers.give_back(np.empty(8 * MiB, np.uint8))
    assert buffers.take(4 * MiB).nbytes == 4 * MiB  # twice the size: not handed out, kept
    assert buffers._waiting_bytes == 8 * MiB
    assert buffers.take(8 * MiB - 4096).nbytes == 8 * MiB


def test_small_and_foreign_buffers_are_not_kept():
    buffers.give_back(memoryview(bytearray(4 * MiB)))
    buffers.give_back(np.empty(MiB // 2, np.uint8))
    buffers.give_back(np.empty((2, 2 * MiB), np.uint8))
    assert buffers._waiting_bytes == 0


def test_at_most_keep_bytes_wait(monkeypatch):
    monkeypatch.setattr(buffers, "_KEEP", 10 * MiB)
    kept = [np.empty(4 * MiB, np.uint8) for _ in range(4)]
    for a in kept:
        buffers.give_back(a)
    assert buffers._waiting_bytes == 8 * MiB
    assert [a is b for a, b in zip(buffers._waiting, kept[2:])] == [True, True]  # the oldest went first


def test_a_block_serialized_into_a_reused_buffer_is_the_block_serialized_into_fresh_memory():
    """Old bytes never show through: header padding and alignment gaps are
    written whatever the buffer held."""
    t = as_tokens(list(range(100, 108)))
    block = Block(t, kv_layers(t, n_layers=2, heads=17, dim=1003))  # odd sizes: gaps between arrays
    fresh = bytes(serialize(block, b"k" * 16))
    assert len(fresh) > MiB
    buffers.give_back(np.full(len(fresh) + 4096, 0xFF, np.uint8))  # what an old block could have left
    reused = serialize(block, b"k" * 16)
    assert buffers._waiting_bytes == 0  # it went into the poisoned buffer
    assert bytes(reused) == fresh


def test_an_owner_collected_while_the_pool_is_locked_neither_deadlocks_nor_keeps_its_reservation():
    """A store never closed is collected whenever the garbage collector runs, which may be inside the
    pool's own lock on the same thread: its reservation is dropped at the next use, not by taking the lock."""
    class Owner:
        pass

    owner = Owner()
    key = id(owner)
    buffers.reserve(owner, 1 << 30)
    assert buffers._reserved[key] == 1 << 30
    with buffers._lock:
        del owner  # its finalizer runs here, on this thread, with the (non-reentrant) lock held
    buffers.reserve(Owner(), 0)  # the next use of the pool
    assert key not in buffers._reserved


class _PinningRuntime:
    """``cuda.Runtime.pinned`` on host memory, counting what it is asked to make."""

    def __init__(self):
        self.made: list[int] = []

    def pinned(self, nbytes: int, tally: "list | None" = None) -> np.ndarray:
        self.made.append(nbytes)
        host = np.empty(nbytes, np.uint8)
        p = cuda._Pinned.__new__(cuda._Pinned)  # (as cudaHostAlloc's memory is wrapped, over host memory)
        p.host, p._free, p.ptr = host, lambda ptr: None, host.ctypes.data
        p.__array_interface__ = dict(host.__array_interface__)
        p._tally = cuda._counted(tally, nbytes)
        return np.asarray(p)


def test_page_locked_memory_made_at_open_is_carved_into_the_first_fills_buffers(monkeypatch):
    """On CUDA a RAM tier makes its first fill's page-locked memory when it
    opens (``prefill``): the next new buffers are parts of it, each its own
    buffer to hand back, and nothing more is made until it is used up."""
    rt = _PinningRuntime()
    monkeypatch.setattr(cuda, "runtime", lambda: rt)
    owner = type("Owner", (), {})()
    buffers.reserve(owner, 64 * MiB)
    buffers.prefill(owner, 10 * MiB)
    assert rt.made == [10 * MiB]
    a, b = buffers.take(4 * MiB), buffers.take(4 * MiB + 1)
    assert rt.made == [10 * MiB]  # carved, not made
    assert b.ctypes.data - a.ctypes.data == 4 * MiB and cuda.is_pinned(a) and cuda.is_pinned(b[10:])
    buffers.give_back(memoryview(b[64:]))
    assert buffers._waiting_bytes == 4 * MiB + 1  # the part, never the arena
    del b
    assert buffers.take(4 * MiB).ctypes.data == a.ctypes.data + 4 * MiB  # reused as any buffer is
    buffers.take(4 * MiB)  # more than the arena has left: made
    assert rt.made == [10 * MiB, 4 * MiB]
    buffers.reserve(owner, 0)  # the owner closing drops what it did not carve
    assert buffers._arenas == {}


@pytest.fixture
def pinned_runtime(monkeypatch):
    monkeypatch.setattr(cuda, "runtime", lambda: _PinningRuntime())
    monkeypatch.setattr(buffers, "_SLACK", 0)


class _Owner:
    pass


def test_page_locked_memory_stays_under_the_budgets_and_is_kept_not_freed(pinned_runtime):
    owner = _Owner()
    buffers.reserve(owner, 40 * MiB)  # a cap of 50 MiB
    before, pageable = buffers._pinned[0], buffers.made[2]
    held = [buffers.take(10 * MiB) for _ in range(5)]
    assert all(cuda.is_pinned(b) for b in held) and buffers._pinned[0] - before == 50 * MiB
    past = buffers.take(10 * MiB)
    assert not cuda.is_pinned(past) and buffers.made[2] - pageable == 10 * MiB  # past the cap: pageable
    buffers.give_back(held.pop())
    smaller = buffers.take(6 * MiB)  # no new page-locked memory: a larger one handed back serves
    assert cuda.is_pinned(smaller) and smaller.nbytes == 10 * MiB and buffers._pinned[0] - before == 50 * MiB
    for b in held + [smaller, past]:
        buffers.give_back(b)
    del held, smaller, past
    buffers.give_back(np.empty(700 * MiB, np.uint8))  # over _KEEP: the pageable ones go, the page-locked stay
    assert [cuda.is_pinned(w) for w in buffers._waiting] == [True] * 5
    assert buffers._pinned[0] - before == 50 * MiB
    buffers.reserve(owner, 0)


def test_a_store_smaller_than_its_puts_makes_its_page_locked_memory_once(monkeypatch):
    """Blocks that fit nowhere (a RAM-only store, a put larger than its
    budget) hand their buffers back like evicted ones: page-locked memory is
    made for the budget's worth of blocks and then only reused, never freed
    and made again (on CUDA each make and free holds up the GPU)."""
    import types

    import mlx.core as mx

    from kvstore.blocks.layers import KVLayer
    from kvstore.store import PrefixStore

    rt = _PinningRuntime()  # (page-locked for the pool only: the rest of the store runs its host paths)
    monkeypatch.setattr(buffers, "cuda", types.SimpleNamespace(runtime=lambda: rt, is_pinned=cuda.is_pinned,
                                                               Carved=cuda.Carved))
    rng = np.random.default_rng(0)
    with PrefixStore(budget_gb=16 / 1024, block_size=256) as s:  # 256-token blocks of 2 MiB
        for i in range(16):
            n = int(rng.integers(600, 6000))  # up to 47 MiB a put
            kv = [mx.random.normal((1, 8, n, 128), key=mx.random.key(i * 2 + j)).astype(mx.float16) for j in range(2)]
            s.put("m", np.arange(n) + i * 100_000, [KVLayer(kv[0], kv[1]), KVLayer(kv[1], kv[0])])
            if i % 4 == 3:
                s.flush()
        s.flush()
        assert s.stats()["evictions_ram"] > 0
        assert buffers._pinned[0] == sum(rt.made)  # nothing made was freed
        assert sum(rt.made) <= buffers._pinned_cap()
