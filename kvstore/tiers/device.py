"""Device tier: hot blocks kept in GPU memory (CUDA), in LRU order under a
byte budget.

A hit that just moved blocks to the GPU leaves them here as they are, with
no copy: a hit's arrays (``HitArrays``, built by ``kvstore.rowcopy``), each
block the rows it holds there; any other layout's
upload buffer, each block its payload bytes laid out as on disk, from which
the next hit cuts its layers on the GPU (``gather``). A later hit of the same
blocks at the same rows gets views of the arrays, so the engine's own
first write is the only device-side copy. Blocks of one hit share its memory,
which is freed once its last block leaves, so the budget counts it whole
while any of them is kept. A block is always also in RAM or on disk: the tier is a cache
over them, and any block may leave it. On Apple silicon and CPUs memory is
one: the RAM tier is the device tier there and this one stays empty (budget
0). The ``BlockTable`` owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import mlx.core as mx
import numpy as np

from ..header import Header
from ..wire import Stored


@dataclass(eq=False)
class HitArrays:
    """The arrays a hit built in GPU memory (``kvstore.rowcopy``), rows of
    several blocks: per kind of array (one for plain KV; data, scales and
    biases for quantized KV) a ``[lines, rows, width]`` array whose lines are
    every layer's keys then values, head by head."""

    kinds: list[mx.array]
    heads: int

    def tensor(self, i: int) -> mx.array:
        """Array ``i`` of a block's ``header.kv_arrays()``, ``[1, heads, rows, width]`` (a view)."""
        t, c = divmod(i, len(self.kinds))
        return self.kinds[c][t * self.heads : (t + 1) * self.heads][None]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.kinds)


@dataclass
class DeviceBlock:
    """A block in GPU memory, with its header: rows ``[row, row + ntokens)``
    of ``arrays``, or ``size`` payload bytes at ``offset`` of ``data`` (uint8);
    either possibly shared with other blocks."""

    key: bytes
    start: int
    header: Header
    size: int
    head: bytes  # the value's bytes before the payload (prefix, header, padding), for a host copy
    tokens: np.ndarray  # its tokens on the host: every hit compares them with the prompt's
    data: Optional[mx.array] = None
    offset: int = 0
    arrays: Optional[HitArrays] = None
    row: int = 0

    @property
    def nbytes(self) -> int:
        return self.size

    @classmethod
    def kept(cls, item, **where) -> "DeviceBlock":
        """``item`` (a ``Stored`` block, or a ``DeviceBlock`` kept elsewhere)
        as it now lies on the GPU: ``data``/``offset`` or ``arrays``/``row``."""
        if isinstance(item, DeviceBlock):
            return cls(item.key, item.start, item.header, item.size, item.head, item.tokens, **where)
        return cls(item.key, item.start, item.header, len(item.payload), bytes(item.buf[: item.header.payload_start]),
                   item.tokens.copy(), **where)

    def to_stored(self) -> Stored:
        """The block as host bytes (for the rare layouts gathered block by block)."""
        if self.arrays is None:
            payload = np.array(self.data[self.offset : self.offset + self.size])
        else:
            payload = np.zeros(self.size, np.uint8)
            tok = self.header.tokens
            payload[tok.offset : tok.offset + tok.nbytes] = self.tokens.astype(tok.np_dtype).view(np.uint8)
            n = self.header.ntokens
            for i, a in enumerate(self.header.kv_arrays()):
                x = self.arrays.tensor(i)[..., self.row : self.row + n, :]
                x = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
                payload[a.offset : a.offset + a.nbytes] = x.reshape(-1).view(np.uint8)
        buf = np.concatenate([np.frombuffer(self.head, np.uint8), payload])
        return Stored(self.key, self.start, memoryview(buf), self.header, checked=True)


class DeviceTier:
    """Blocks in GPU memory under a budget of the memory they hold: the
    arrays (or buffer) a block lies in count whole while any of its blocks
    is kept, since none of it is freed before the last one leaves."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.nbytes = 0
        self._blocks: "OrderedDict[bytes, DeviceBlock]" = OrderedDict()
        self._held: dict[int, list] = {}  # id of the memory blocks lie in -> [its bytes, blocks kept in it]

    def get(self, key: bytes) -> Optional[DeviceBlock]:
        return self._blocks.get(key)

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def _memory(block: DeviceBlock) -> tuple[int, int]:
        if block.arrays is not None:
            return id(block.arrays), block.arrays.nbytes
        return id(block.data), block.data.nbytes

    def add(self, block: DeviceBlock, pinned: Callable[[bytes], bool]) -> bool:
        """Keep ``block``, evicting the least recently used blocks not
        ``pinned`` to make room; False when it does not fit."""
        mem, size = self._memory(block)
        if size > self.budget:
            return False
        self.pop(block.key)
        for key in list(self._blocks):
            if self.nbytes + (0 if mem in self._held else size) <= self.budget:
                break
            if not pinned(key):
                self.pop(key)
        cost = 0 if mem in self._held else size
        if self.nbytes + cost > self.budget:
            return False
        self._blocks[block.key] = block
        self._held.setdefault(mem, [size, 0])[1] += 1
        self.nbytes += cost
        return True

    def pop(self, key: bytes) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            mem, _ = self._memory(block)
            held = self._held[mem]
            held[1] -= 1
            if held[1] == 0:
                del self._held[mem]
                self.nbytes -= held[0]

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def shrink(self, keep_bytes: int) -> None:
        """Least recently used blocks out until at most ``keep_bytes`` are held."""
        while self._blocks and self.nbytes > keep_bytes:
            self.pop(next(iter(self._blocks)))
