"""A shared/exclusive gate around an LMDB environment: transactions share it;
``set_mapsize`` needs it alone, since LMDB allows a resize only while this
process has no transaction open."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class Gate:
    """Shared for transactions, exclusive for ``set_mapsize`` (which LMDB
    allows only while this process has no transaction open)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._excl = False

    def acquire_shared(self) -> None:
        with self._cond:
            while self._excl:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
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
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._excl = False
                self._cond.notify_all()
