"""Independent per-layer work spread over the CPU's cores.

mlx runs the ops of one stream one after another on one thread, so on the CPU
a fetch that concatenates or dequantizes dozens of independent layers keeps
one core busy and the others idle. A few worker threads, each with its own
(thread-local) mlx stream, run those layers side by side: about 1.9x on 2
cores for both copies and dequantizing. Work items must build their arrays
from evaluated inputs only (a lazy array of the caller's stream cannot be
evaluated on another thread); results come back evaluated. On a GPU the work
runs in the caller: its kernels already fill the device.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

import mlx.core as mx

from ..blocks.layers import Quantized

T = TypeVar("T")

_MAX_WORKERS = 8
_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_cap = _MAX_WORKERS


def _forget_pools() -> None:
    """In a child of ``fork()``: the parent's pool threads are not here, and
    a pool that thinks it has them would never run the child's work. Nor is
    the thread behind the forking thread's default CPU stream: mlx runs a CPU
    stream's ops on a thread of its own, started at the stream's first use, so
    in a child of a thread that had evaluated on the CPU every ``mx.eval`` of
    that stream waited forever (a one-layer fetch, run in the caller, hung;
    more layers ran on the pool's new threads). The child gets a new one."""
    global _lock, _pools
    _lock, _pools = threading.Lock(), {}
    mx.set_default_stream(mx.new_stream(mx.cpu))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def workers() -> int:
    return max(1, min(os.cpu_count() or 1, _cap))


def set_max_workers(n: int) -> int:
    """Use at most ``n`` threads from now on (1: all work in the caller), for
    A/B measurements; returns the previous cap."""
    global _cap
    prev, _cap = _cap, max(1, min(int(n), _MAX_WORKERS))
    return prev


def pool(name: str = "spread") -> ThreadPoolExecutor:
    """The process-wide pool of ``workers()`` threads called ``name``. Work
    that may block on what another pool's work holds gets a pool of its own
    (LMDB read-ahead waits on the map's gate, which a gather holds)."""
    p = _pools.get(name)  # (a dict read: made once, then no lock per submit)
    if p is not None:
        return p
    with _lock:
        p = _pools.get(name)
        if p is None:
            p = _pools[name] = ThreadPoolExecutor(workers(), thread_name_prefix=f"kvstore-{name}")
        return p


def evaluate(items: Sequence) -> None:
    """``mx.eval`` of mlx arrays and ``Quantized`` triples (``None`` skipped)."""
    arrays = []
    for t in items:
        if isinstance(t, Quantized):
            arrays.extend(t.arrays())
        elif t is not None:
            arrays.append(t)
    if arrays:
        mx.eval(arrays)


def _run(chunk: Sequence[Callable[[], T]]) -> list[T]:
    out = [work() for work in chunk]
    evaluate(out)
    return out


def each(fn: Callable[[int], T], n: int) -> list[T]:
    """``fn(0), ..., fn(n - 1)`` on the worker threads, results in order: for
    work that releases the GIL (copies, hashes, copy-engine transfers), on
    every device."""
    if n < 2 or workers() < 2:
        return [fn(i) for i in range(n)]
    workers_pool = pool()
    futures = [workers_pool.submit(fn, i) for i in range(n)]
    wait(futures)  # every one finished before an error is raised: callers free what the others still use
    return [f.result() for f in futures]


def spread(work: Sequence[Callable[[], T]]) -> list[T]:
    """Results of ``work`` in order, evaluated, computed on every core where
    mlx runs on the CPU."""
    n = min(len(work), workers())
    if n < 2 or mx.default_device() != mx.cpu:
        return _run(work)
    size = -(-len(work) // n)
    futures = [pool().submit(_run, work[i : i + size]) for i in range(0, len(work), size)]
    return [r for f in futures for r in f.result()]
