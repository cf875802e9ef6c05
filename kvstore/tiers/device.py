"""Device tier: hot blocks kept in GPU memory (CUDA), in LRU order under a
byte budget.

A block is held as its payload bytes in GPU memory, laid out exactly as on
disk, so a hit cuts each layer's arrays out of them on the GPU: no host copy
and no transfer, one device-side copy when the layers are assembled
(``gather``). Blocks come here from a hit that just moved them to the GPU:
the buffer that hit uploaded them into is kept as it is (no copy), so the
blocks of one hit share it, lie side by side, and the next hit cuts a run of
them with one strided view per array, as from the host. The memory of a
shared buffer is freed once its last block leaves (the budget counts each
block's own bytes). A block is always also in RAM or on disk: the tier is a
cache over them, and any block may leave it. On Apple silicon and CPUs memory is one: the RAM tier is the
device tier there and this one stays empty (budget 0). The ``BlockTable``
owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import mlx.core as mx
import numpy as np

from ..header import Header
from ..wire import Stored


@dataclass
class DeviceBlock:
    """A block's payload in GPU memory: ``size`` bytes at ``offset`` of
    ``data`` (uint8, possibly shared with other blocks), with its header."""

    key: bytes
    start: int
    header: Header
    data: mx.array
    offset: int
    size: int
    head: bytes  # the value's bytes before the payload (prefix, header, padding), for a host copy
    tokens: np.ndarray  # its tokens on the host: every hit compares them with the prompt's

    @property
    def nbytes(self) -> int:
        return self.size

    def to_stored(self) -> Stored:
        """The block as host bytes (for the rare layouts gathered block by block)."""
        payload = np.array(self.data[self.offset : self.offset + self.size])
        buf = np.concatenate([np.frombuffer(self.head, np.uint8), payload])
        return Stored(self.key, self.start, memoryview(buf), self.header, checked=True)


class DeviceTier:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.nbytes = 0
        self._blocks: "OrderedDict[bytes, DeviceBlock]" = OrderedDict()

    def get(self, key: bytes) -> Optional[DeviceBlock]:
        return self._blocks.get(key)

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, block: DeviceBlock, pinned: Callable[[bytes], bool]) -> bool:
        """Keep ``block``, evicting the least recently used blocks not
        ``pinned`` to make room; False when it does not fit."""
        if block.nbytes > self.budget:
            return False
        self.pop(block.key)
        for key in list(self._blocks):
            if self.nbytes + block.nbytes <= self.budget:
                break
            if not pinned(key):
                self.pop(key)
        if self.nbytes + block.nbytes > self.budget:
            return False
        self._blocks[block.key] = block
        self.nbytes += block.nbytes
        return True

    def pop(self, key: bytes) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.nbytes -= block.nbytes

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def shrink(self, keep_bytes: int) -> None:
        """Least recently used blocks out until at most ``keep_bytes`` are held."""
        while self._blocks and self.nbytes > keep_bytes:
            self.pop(next(iter(self._blocks)))
