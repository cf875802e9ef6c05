"""RAM tier: decoded blocks in LRU order under a byte budget.

Bytes are counted from what is held (``nbytes`` of trimmed, possibly
quantized arrays), never from an engine's over-allocated buffer. The tier only
keeps order and counts; which block may go (pinned, not yet on disk) is the
store's decision (``placement``). Every verb is O(1) per block: the order is
an ``OrderedDict``, and ``oldest`` walks it without copying.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Mapping, Optional, Sequence

from ..codec import Block
from .base import Entry, Loaded, Use


class RamTier:
    name = "ram"

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.nbytes = 0
        self._blocks: "OrderedDict[bytes, Block]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> Optional[Block]:
        return self._blocks.get(key)

    # ------------------------------------------------------------ protocol

    def load(self, wanted: Sequence[tuple[bytes, int]]) -> Loaded:
        out = Loaded()
        for key, _ in wanted:
            block = self._blocks.get(key)
            if block is None:
                break
            out.blocks[key] = block
        return out

    def store(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self.add(e.key, e.block)

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
        self._blocks.clear()
        self.nbytes = 0

    # ------------------------------------------------------- single blocks

    def add(self, key: bytes, block: Block) -> None:
        self.pop(key)
        self._blocks[key] = block
        self.nbytes += block.nbytes

    def pop(self, key: bytes) -> Optional[Block]:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.nbytes -= block.nbytes
        return block

    def oldest(self) -> Iterator[tuple[bytes, Block]]:
        """Blocks from least to most recently used. Lazy: stop iterating
        before changing the tier."""
        return iter(self._blocks.items())

    def over(self, extra: int = 0) -> int:
        """Bytes above budget if ``extra`` more were added."""
        return self.nbytes + extra - self.budget
