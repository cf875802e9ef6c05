"""A block as it lies in GPU memory (CUDA): in a hit's per-layer arrays
(``HitArrays``, built by ``kvstore.convert.rowcopy``) or in an upload buffer
of payload bytes laid out as on disk; what the device tier keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from .header import Header
from .wire import Stored


@dataclass(eq=False)
class HitArrays:
    """The arrays a hit built in GPU memory (``kvstore.convert.rowcopy``), rows of
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
