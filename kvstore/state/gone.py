"""Blocks that left the index, and why: what a later miss on them is told.

A fetch that finds no block where the prompt's chain goes on asks here
whether this process once held it. Keys are chained over the prompt, so a
dropped block's subtree is recorded with it and every later block of the
same prompt reads the same reason. Bounded: the oldest reasons are
forgotten first (a forgotten block reads as ``new``); a restart forgets
them all (the disk keeps blocks, not their absences)."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

REMEMBERED = 1 << 16  # blocks (about 100 bytes each): 16M tokens of 256-token blocks


class Gone:
    """``key -> reason`` for blocks dropped from every tier (insertion order: oldest first). Owned by the
    ``BlockTable``, under its lock."""

    def __init__(self, limit: int = REMEMBERED):
        self._why: dict[bytes, str] = {}
        self._limit = limit

    def add(self, keys: Iterable[bytes], why: str) -> None:
        d = self._why
        for k in keys:
            d.pop(k, None)  # (re-recorded: the newest)
            d[k] = why
        while len(d) > self._limit:
            del d[next(iter(d))]

    def why(self, keys: Sequence[bytes]) -> list[Optional[str]]:
        d = self._why
        return [d.get(k) for k in keys]
