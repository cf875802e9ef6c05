"""The store's public inspection points, for operators and tests.

``PrefixStore`` inherits them (``Inspection``), so its facade module keeps
the put and fetch paths alone; what a test needs to see or hold is named here,
documented and typed, instead of being reached as a private part of the store.
None of them changes what the store stores or serves.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class StoreDebug:
    """A snapshot of where the store's blocks are, taken at one moment.

    ``ram_keys``: the blocks the RAM tier holds, least recently used first;
    ``device_keys``: those kept in GPU memory (CUDA only; empty elsewhere);
    ``pending_jobs`` / ``pending_bytes``: puts handed to the writer and not yet
    done, and the engine arrays they keep alive.
    """

    ram_keys: tuple[bytes, ...]
    device_keys: tuple[bytes, ...]
    pending_jobs: int
    pending_bytes: int


class Inspection:
    """What ``PrefixStore`` shows of itself beyond ``stats()`` (mixed in)."""

    # ---- inspection (public, for operators and tests)

    def debug(self) -> StoreDebug:
        """Which blocks each local tier holds and what the writer has queued (``StoreDebug``)."""
        self._check_open()
        ram, dev = self._table.keys_held()
        return StoreDebug(ram_keys=ram, device_keys=dev, pending_jobs=self._writer.pending_jobs,
                          pending_bytes=self._writer.pending_bytes)

    def held_bytes(self, key: bytes) -> Optional[bytes]:
        """A copy of the serialized block the RAM tier holds under ``key`` (the
        bytes LMDB and the remote tier store); ``None`` when RAM lacks it."""
        self._check_open()
        held = self._table.held(key)
        return None if held is None else bytes(held.buf)

    @contextmanager
    def pause_writer(self) -> Iterator[None]:
        """Hold the writer thread until the block ends: puts made meanwhile
        are queued (counted in ``pending_bytes``, bounded by
        ``max_pending_bytes``) and none is encoded or written yet. Where no
        writer thread can start, puts run in the caller and nothing is held."""
        self._check_open()
        go, caller = threading.Event(), threading.current_thread()

        def hold() -> None:
            if threading.current_thread() is not caller:  # (run inline where no thread starts: never wait there)
                go.wait()

        self._writer.later(hold)
        try:
            yield
        finally:
            go.set()

    @contextmanager
    def engine_call(self) -> Iterator[None]:
        """Mark an engine call under way for the block's length, as ``put`` and
        ``fetch`` do: the writer waits between blocks (at most
        ``writer_patience_s`` at each) until it ends. For an engine that makes
        several calls in a row and wants the writer out of the way meanwhile."""
        with self._engine.engine():
            yield
