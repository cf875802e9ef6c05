"""RAM tier: blocks as their serialized bytes, in LRU order under a byte budget.

A block is held exactly as the disk and the remote tier store it
(``codec.Stored``, checked): what the budget counts is what is held, with no
engine buffer or device memory behind it. On CUDA this makes ``budget_gb``
host RAM, as on every other backend; a hit from RAM takes the same one-copy
route to the engine's device as one from disk (``gather``), and a block read
from disk is promoted with one copy of its bytes, not a decode. The tier only
keeps order and counts; which block may go (pinned, not yet on disk) is the
store's decision (``placement``). Every verb is O(1) per block: the order is
an ``OrderedDict``, and ``oldest`` walks it without copying.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Mapping, Optional, Sequence

from .. import buffers
from ..wire import Stored
from .base import Entry, Loaded, Use


class RamTier:
    name = "ram"

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.nbytes = 0
        self._blocks: "OrderedDict[bytes, Stored]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> Optional[Stored]:
        return self._blocks.get(key)

    # ------------------------------------------------------------ protocol

    def load(self, wanted: Sequence[tuple[bytes, int]]) -> Loaded:
        out = Loaded()
        for key, _ in wanted:
            held = self._blocks.get(key)
            if held is None:
                break
            out.blocks[key] = held.decode()
        return out

    def store(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self.add(e.key, Stored.of(e.payload, e.key, e.record.start, checked=True))

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        return [k for k in keys if self.pop(k) is not None]

    def touch(self, uses: Mapping[bytes, Use]) -> None:
        """Most recently used last: ``uses`` in the order given."""
        for key in uses:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def usage(self) -> int:
        return self.nbytes

    def close(self) -> None:
        while self._blocks:
            self.pop(next(iter(self._blocks)))

    # ------------------------------------------------------- single blocks

    def add(self, key: bytes, held: Stored) -> None:
        self.pop(key)
        self._blocks[key] = held
        self.nbytes += held.nbytes

    def pop(self, key: bytes) -> Optional[Stored]:
        held = self._blocks.pop(key, None)
        if held is not None:
            self.nbytes -= held.nbytes
            buffers.give_back(held.buf)  # reused once whoever still reads it lets go
        return held

    def oldest(self) -> Iterator[tuple[bytes, Stored]]:
        """Blocks from least to most recently used. Lazy: stop iterating
        before changing the tier."""
        return iter(self._blocks.items())

    def over(self, extra: int = 0) -> int:
        """Bytes above budget if ``extra`` more were added."""
        return self.nbytes + extra - self.budget
