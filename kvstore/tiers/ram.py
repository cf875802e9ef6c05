"""RAM tier: blocks in LRU order under a byte budget.

Bytes are counted from what is held (``nbytes`` of trimmed, possibly
quantized arrays), never from an engine's over-allocated buffer. The tier only
keeps order and counts; which block may go (pinned, not yet on disk) is the
store's decision.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional

from ..codec import Block


class RamTier:
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

    def touch(self, key: bytes) -> None:
        """Mark as most recently used."""
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def add(self, key: bytes, block: Block) -> None:
        old = self._blocks.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._blocks[key] = block
        self.nbytes += block.nbytes

    def remove(self, key: bytes) -> Optional[Block]:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.nbytes -= block.nbytes
        return block

    def lru(self) -> Iterator[bytes]:
        """Keys from least to most recently used (a snapshot)."""
        return iter(list(self._blocks))

    def over(self, extra: int = 0) -> int:
        """Bytes above budget if ``extra`` more were added."""
        return self.nbytes + extra - self.budget
