"""A shared/exclusive gate around an LMDB environment: transactions share it;
``set_mapsize`` needs it alone, since LMDB allows a resize only while this
process has no transaction open. Given the store's directory, the exclusive
side also holds an ``flock`` on it, which every process of the store takes to
open it and to change its map: with a writable map LMDB truncates the file to
the size a process maps, so those steps must not interleave between
processes."""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional


class Gate:
    """Shared for transactions, exclusive for ``set_mapsize`` (which LMDB
    allows only while this process has no transaction open); exclusive across
    processes too when ``lock_dir`` is given."""

    def __init__(self, lock_dir: Optional[Path] = None):
        self._cond = threading.Condition()
        # thread -> transactions it holds: each thread changes only its own entry (single dict operations, atomic
        # under the GIL), so a transaction takes no lock unless a resize is waiting or under way
        self._readers: dict[int, int] = {}
        self._excl = False
        self.lock_dir = lock_dir

    def acquire_shared(self) -> None:
        me, readers = threading.get_ident(), self._readers
        readers[me] = readers.get(me, 0) + 1  # counted first, then the exclusive side looked at: a resize that
        if not self._excl:                   # starts after this look waits for this count to go
            return
        self._leave(me)  # a resize waits or runs: step back, and come in under the lock once it is done
        with self._cond:
            while self._excl:
                self._cond.wait()
            readers[me] = readers.get(me, 0) + 1

    def release_shared(self) -> None:
        self._leave(threading.get_ident())

    def _leave(self, me: int) -> None:
        readers = self._readers
        left = readers[me] - 1
        if left:
            readers[me] = left
        else:
            del readers[me]
        if self._excl:  # a resize may be waiting for the last transaction (it looks under the lock)
            with self._cond:
                self._cond.notify_all()

    @contextmanager
    def shared(self):
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._excl:
                self._cond.wait()
            self._excl = True
            while self._readers:
                self._cond.wait()
        fd = None
        try:
            if self.lock_dir is not None:
                fd = os.open(self.lock_dir, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or when the process dies
            yield
        finally:
            if fd is not None:
                os.close(fd)
            with self._cond:
                self._excl = False
                self._cond.notify_all()
