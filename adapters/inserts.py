"""Engine caches handed to the store off the engine's thread (mlx-lm's
server and vllm-mlx's scheduler both insert between two steps)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

import mlx.core as mx

from kvstore import PrefixStore

from .mlx_lm import caches_to_layers

log = logging.getLogger("kvstore")


class Inserts:
    """Puts run on a thread of their own, so an insert costs the engine's
    generation thread only a snapshot of its cache (no op, no copy, no wait
    for the step still computing). A fetch first waits for the inserts of its
    model in flight: a follow-up sent the moment a response ends (the servers
    send the end before they insert) still finds its prefix."""

    def __init__(self, store: PrefixStore):
        self.store = store
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def submit(self, key: str, tokens: list[int], parts: list, arrays: list[mx.array]) -> None:
        with self._cond:
            self._pending[key] = self._pending.get(key, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-inserts", daemon=True)
                self._thread.start()
        self._queue.put((key, tokens, parts, arrays))

    def wait(self, key: Optional[str] = None) -> None:
        """Until no insert (of ``key``, or of any model) is in flight."""
        with self._cond:
            while self._pending.get(key) if key is not None else self._pending:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, tokens, parts, arrays = item
            layers = None
            try:
                mx.eval(arrays)  # scheduled on the engine's stream: this waits for them, it computes nothing
                n, layers = caches_to_layers(parts, copy=False)
                self.store.put(key, tokens[:n], layers)
            except Exception:
                log.exception("kvstore: storing a cache failed; it is skipped")
            finally:
                item = parts = arrays = layers = None  # let go of the engine's buffers before waiting for the next one
                with self._cond:
                    self._pending[key] -= 1
                    if not self._pending[key]:
                        del self._pending[key]
                    self._cond.notify_all()
