"""The engine's calls come first: while a ``fetch`` or ``put`` runs on an
engine's thread, the writer waits between blocks.

Python runs one thread at a time. A fetch gives the interpreter up at every
call that leaves it (a copy started, an mlx evaluation), and a busy writer
thread would then keep it for up to the switch interval (5 ms) each time: a
fetch that leaves the interpreter a hundred times would wait half a second
behind a put's encoding. So the writer asks here before each block and waits
while an engine call is under way; the wait is bounded, so engine calls that
follow each other without a gap slow the writer down but never stop it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class EngineFirst:
    def __init__(self, patience_s: float):
        # engine thread -> its calls under way: each thread changes only its own entry (single dict operations,
        # atomic under the GIL), so an engine call takes no lock; the writer reads it without one
        self._busy: dict[int, int] = {}
        self._waiting = 0  # background threads waiting for the engine calls to end (changed under ``_quiet``)
        self._quiet = threading.Condition(threading.Lock())
        self.patience_s = patience_s  # the longest a background thread waits at one step

    @contextmanager
    def engine(self) -> Iterator[None]:
        """Around an engine thread's call into the store (never one that waits on the writer)."""
        me, busy = threading.get_ident(), self._busy
        busy[me] = busy.get(me, 0) + 1
        try:
            yield
        finally:
            left = busy[me] - 1
            if left:
                busy[me] = left
            else:
                del busy[me]
                # a waiter counted after this look finds ``busy`` empty under the lock and does not wait
                if self._waiting and not busy:
                    with self._quiet:
                        self._quiet.notify_all()

    def yield_to_engine(self) -> None:
        """On a background thread between two steps: wait while an engine call runs (at most ``patience_s``)."""
        if self._busy:  # (read without the lock: a stale answer costs one step's wait or one step's head start)
            with self._quiet:
                self._waiting += 1
                try:
                    self._quiet.wait_for(lambda: not self._busy, self.patience_s)
                finally:
                    self._waiting -= 1
