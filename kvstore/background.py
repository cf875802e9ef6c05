"""Background threads started on first use and again wherever they are not
running: not yet, ended (an idle thread leaves), or in a forked child, which
has none of its parent's threads. Every thread and pool of the store starts
here (the writer, the commit thread, promotions, the remote's write-behind
and read-ahead)."""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional


def running(thread: Optional[threading.Thread], jobs: Optional[queue.Queue], loop: Callable[[queue.Queue], None],
            name: str) -> tuple[threading.Thread, queue.Queue]:
    """``thread`` while it runs, else a new daemon thread running ``loop(jobs)``
    on a queue of its own (``jobs`` only for a first start, where items may be
    queued already): a queue a parent's thread waited on would hand the next item
    to a thread that does not exist here. Raises ``RuntimeError`` where no thread
    can start (an interpreter exiting, Python 3.12+). Call under the owner's lock."""
    if thread is not None and thread.is_alive():
        return thread, jobs
    if thread is not None or jobs is None:
        jobs = queue.Queue()
    thread = threading.Thread(target=loop, args=(jobs,), name=name, daemon=True)
    thread.start()
    return thread, jobs


class Pools:
    """Single-thread executors by name, made on first use, and anew in a forked child."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pid = 0

    def get(self, name: str = "") -> ThreadPoolExecutor:
        pool = self._pools.get(name) if self._pid == os.getpid() else None  # (a dict read: made once, no lock)
        if pool is not None:
            return pool
        with self._lock:
            if self._pid != os.getpid():
                self._pools, self._pid = {}, os.getpid()
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(1, thread_name_prefix=self.prefix + name)
            return pool

    def shutdown(self, wait: bool = True) -> None:
        """Shut this process's pools down (a forked child's copies of its parent's are left alone)."""
        with self._lock:
            pools, self._pools = (self._pools if self._pid == os.getpid() else {}), {}
        for pool in pools.values():
            pool.shutdown(wait=wait)
