"""RAM tier: blocks as their serialized bytes, in LRU order under a byte budget.

A block is held exactly as the disk and the remote tier store it
(``wire.Stored``, checked): what the budget counts is what is held, with no
engine buffer or device memory behind it. On CUDA this makes ``budget_gb``
host RAM, as on every other backend; a hit from RAM takes the same one-copy
route to the engine's device as one from disk (``gather``), and a block read
from disk is promoted with one copy of its bytes, not a decode. The tier only
keeps order and counts; which block may go is the ``BlockTable``'s decision
(its only owner). Every verb is O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator, Optional, Sequence

from ..gpu import buffers
from ..blocks.record import Entry
from ..blocks.wire import Stored


PREFILL = 8 << 30  # page-locked bytes made at open at most (making them is slow: ``buffers.reserve``)


class RamTier:
    """A ``Tier`` (``tiers.base``): its blocks are host copies, checked."""

    name = "ram"

    def __init__(self, budget_bytes: int):
        self.nbytes = 0
        self._blocks: "OrderedDict[bytes, Stored]" = OrderedDict()
        self.set_budget(budget_bytes)
        # on CUDA the first fill's page-locked buffers, made now: made while an engine runs, they hold up its kernels
        buffers.prefill(self, min(self.budget, PREFILL))

    def set_budget(self, budget_bytes: int) -> None:
        """The budget; the buffers blocks leave behind are kept for reuse up
        to it (``buffers.reserve``: on CUDA, making and freeing them is slow)."""
        self.budget = int(budget_bytes)
        buffers.reserve(self, self.budget)

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> Optional[Stored]:
        return self._blocks.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[Stored]]:
        """``get`` of each key (a fetch's path at once)."""
        blocks = self._blocks
        return [blocks.get(k) for k in keys]

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, entries: Sequence[Entry]) -> int:
        """Copies of blocks that fit under the budget as it is (the table makes room, not the tier)."""
        kept = 0
        for e in entries:
            held = Stored.of(e.payload, e.key, e.record.start).held()
            if held is not None and self.over(held.nbytes) <= 0:
                self.add(e.key, held)
                kept += 1
        return kept

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        return [k for k in keys if self.pop(k) is not None]

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

    def touch(self, keys: Iterable[bytes]) -> None:
        """Most recently used last: ``keys`` in the order given."""
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def oldest(self) -> Iterator[tuple[bytes, Stored]]:
        """Blocks from least to most recently used. Lazy: stop iterating
        before changing the tier."""
        return iter(self._blocks.items())

    def over(self, extra: int = 0) -> int:
        """Bytes above budget if ``extra`` more were added."""
        return self.nbytes + extra - self.budget
