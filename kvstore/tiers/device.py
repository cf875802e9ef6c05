"""Device tier: hot blocks kept in GPU memory (CUDA), in LRU order under a
byte budget.

A hit that just moved blocks to the GPU leaves them here as they are, with
no copy: a hit's arrays (``HitArrays``, built by ``kvstore.convert.rowcopy``), each
block the rows it holds there; any other layout's
upload buffer, each block its payload bytes laid out as on disk, from which
the next hit cuts its layers on the GPU (``gather``). A later hit of the same
blocks at the same rows gets views of the arrays, so the engine's own
first write is the only device-side copy. Blocks of one hit share its memory,
which is freed once its last block leaves, so the budget counts it whole
while any of them is kept. A block kept here leaves RAM (the table's ``DeviceSide``), and one
evicted goes back there where no other tier holds it. On Apple silicon and CPUs memory is
one: the RAM tier is the device tier there and this one stays empty (budget
0). The ``BlockTable`` owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..blocks.ondevice import DeviceBlock
from ..blocks.record import Entry
from ..blocks.wire import Stored


class DeviceTier:
    """Blocks in GPU memory under a budget of the memory they hold: the
    arrays (or buffer) a block lies in count whole while any of its blocks
    is kept, since none of it is freed before the last one leaves. A ``Tier``
    (``tiers.base``) whose ``get`` hands out a ``DeviceBlock`` (``to_stored()``:
    its bytes on the host)."""

    name = "device"

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.nbytes = 0
        self._blocks: "OrderedDict[bytes, DeviceBlock]" = OrderedDict()
        self._held: dict[int, list] = {}  # id of the memory blocks lie in -> [its bytes, blocks kept in it]

    def get(self, key: bytes) -> Optional[DeviceBlock]:
        return self._blocks.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[DeviceBlock]]:
        """``get`` of each key (a fetch's path at once)."""
        blocks = self._blocks
        return [blocks.get(k) for k in keys] if blocks else [None] * len(keys)

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, entries: Sequence[Entry]) -> int:
        """Each block's payload uploaded to GPU memory of its own (a hit's blocks come by ``add``, where they
        already lie in the hit's memory)."""
        kept = 0
        for e in entries:
            held = Stored.of(e.payload, e.key, e.record.start).held()
            if held is not None:
                data = mx.array(np.frombuffer(held.payload, np.uint8))
                kept += self.add(DeviceBlock.kept(held, data=data), lambda key: False)
        return kept

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        out = [k for k in keys if k in self._blocks]
        for k in out:
            self.pop(k)
        return out

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> tuple[bytes, ...]:
        """The blocks held, least recently used first."""
        return tuple(self._blocks)

    @staticmethod
    def _memory(block: DeviceBlock) -> tuple[int, int]:
        if block.arrays is not None:
            return id(block.arrays), block.arrays.nbytes
        return id(block.data), block.data.nbytes

    def add(self, block: DeviceBlock, pinned: Callable[[bytes], bool], evicted: Optional[list] = None) -> bool:
        """Keep ``block``, evicting the least recently used blocks not ``pinned`` to make room (added to
        ``evicted``); False when it does not fit."""
        mem, size = self._memory(block)
        if size > self.budget:
            return False
        self.pop(block.key)
        for key in list(self._blocks):
            if self.nbytes + (0 if mem in self._held else size) <= self.budget:
                break
            if not pinned(key):
                _out(evicted, self.pop(key))
        cost = 0 if mem in self._held else size
        if self.nbytes + cost > self.budget:
            return False
        self._blocks[block.key] = block
        self._held.setdefault(mem, [size, 0])[1] += 1
        self.nbytes += cost
        return True

    def pop(self, key: bytes) -> Optional[DeviceBlock]:
        block = self._blocks.pop(key, None)
        if block is not None:
            mem, _ = self._memory(block)
            held = self._held[mem]
            held[1] -= 1
            if held[1] == 0:
                del self._held[mem]
                self.nbytes -= held[0]
        return block

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def shrink(self, keep_bytes: int, evicted: Optional[list] = None) -> None:
        """Least recently used blocks out (added to ``evicted``) until at most ``keep_bytes`` are held."""
        while self._blocks and self.nbytes > keep_bytes:
            _out(evicted, self.pop(next(iter(self._blocks))))


def _out(evicted: Optional[list], block: Optional[DeviceBlock]) -> None:
    if evicted is not None and block is not None:
        evicted.append(block)
