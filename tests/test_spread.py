"""kvstore.convert.spread: per-layer work on every core, results in order, and a cap
on the threads it uses (1: everything in the caller)."""

import os
import threading

import mlx.core as mx
import pytest

from kvstore.convert import spread


def _run(n):
    """spread() of ``n`` items; (values in result order, names of the threads that ran them)."""
    names = set()

    def item(i):
        def fn():
            names.add(threading.current_thread().name)
            return mx.full((4,), i, mx.float32)
        return fn

    out = spread.spread([item(i) for i in range(n)])
    return [int(a[0].item()) for a in out], names


def test_results_in_order_and_capped_to_the_caller():
    prev = spread.set_max_workers(1)
    try:
        assert spread.workers() == 1
        assert _run(6) == (list(range(6)), {threading.current_thread().name})
    finally:
        spread.set_max_workers(prev)
    assert spread.workers() == min(os.cpu_count() or 1, prev)


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or mx.default_device() != mx.cpu, reason="needs 2 CPU cores")
def test_work_runs_on_worker_threads_without_a_cap():
    values, names = _run(6)
    assert values == list(range(6))
    assert names and all(n.startswith("kvstore-spread") for n in names)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_each_raises_only_once_every_task_has_finished():
    """A caller frees what its tasks use (a landing buffer) when ``each``
    returns or raises: no task may still be running then."""
    finished = threading.Event()

    def task(i):
        if i == 0:
            raise RuntimeError("a bad block")
        finished.wait(0.2)  # still running when task 0 has failed
        finished.set()
        return i

    with pytest.raises(RuntimeError, match="a bad block"):
        spread.each(task, 2)
    assert finished.is_set()
