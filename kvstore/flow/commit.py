"""The commit thread and the feed of one write transaction: the writer
thread encodes blocks into a ``Feed`` while the commit thread copies them
into LMDB, so the disk writes the first block while later ones are still
being encoded."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional

from ..background import running
from ..errors import StorageError

Item = Any  # (node, entry): what the writer hands the transaction


class Committer:
    """The commit thread: write transactions, one after another, each taking
    its blocks from a ``Feed`` while the writer thread fills it. A thread of
    its own rather than an executor's: executors refuse work once the
    interpreter is exiting, and the store's exit hook still writes every
    pending block through it. It ends after a few idle seconds (it holds
    nothing of the store, so a store dropped unclosed is still collected)."""

    IDLE = 5.0

    def __init__(self):
        self._jobs: "queue.Queue[Optional[tuple[Future, Callable, tuple]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        done: Future = Future()
        with self._lock:
            # (not yet, idle, or a forked child; RuntimeError where no thread can start: nothing is queued then)
            self._thread, self._jobs = running(self._thread, self._jobs, self._loop, "kvstore-commit")
            self._jobs.put((done, fn, args))
        return done

    def stop(self) -> None:
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join(timeout=60)

    def _loop(self, jobs: "queue.Queue") -> None:
        while True:
            try:
                job = jobs.get(timeout=self.IDLE)
            except queue.Empty:
                job = None
            if job is None:  # idle, or stopped: ends unless work came meanwhile
                with self._lock:
                    if jobs.empty():
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
                continue
            done, fn, args = job
            settle(done, fn, *args)
            job = done = fn = args = None  # (not kept while waiting: they hold the writer, the engine's arrays)


def settle(done: Future, fn: Callable, *args) -> None:
    """Run ``fn(*args)`` into ``done``: the writer waits on it and decides."""
    if done.set_running_or_notify_cancel():
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)


class Feed:
    """The blocks of one write transaction, from the writer thread (``put``,
    as each is encoded) to the commit thread (iterating, as LMDB copies
    each): the disk writes the first block while later ones are encoded,
    instead of waiting for a whole batch. At most ``ahead`` bytes wait to be
    taken; past that the writer waits, so the bytes held stay bounded."""

    def __init__(self, ahead: Optional[int]):
        self.ahead = ahead  # None: no bound (nothing takes from it until it is closed)
        self.opened = time.monotonic()
        self.on_close: Optional[Callable[[], None]] = None  # run by close(), in its caller
        self.nbytes = 0  # put so far
        self.taken: list[Item] = []
        self._items: "deque[tuple[Item, int]]" = deque()
        self._waiting = 0  # bytes put and not yet taken
        self._closed = self._abandoned = False
        self._cond = threading.Condition()

    def put(self, item: Item, nbytes: int) -> None:
        with self._cond:
            while self.ahead is not None and self._waiting >= self.ahead and not self._abandoned:
                self._cond.wait()
            if self._abandoned:  # the transaction it was for failed: nothing will take this
                raise StorageError("the write transaction these blocks were for has ended")
            self._items.append((item, nbytes))
            self._waiting += nbytes
            self.nbytes += nbytes
            self._cond.notify_all()

    def close(self) -> None:
        """Nothing more comes: iterating ends once the rest is taken."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self.on_close is not None:
            self.on_close()

    def abandon(self) -> None:
        """The commit thread is done with it (or failed): ``put`` no longer waits."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def __iter__(self) -> Iterator[Item]:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                item, nbytes = self._items.popleft()
                self._waiting -= nbytes
                self._cond.notify_all()
            self.taken.append(item)
            yield item
