"""Blocks of a hit to one tensor per layer, as the engine takes them.

Per layer, the rows of ``[0, length)`` (or of its sliding window) of every
block, concatenated once; quantized entries are concatenated per part before
anything is dequantized, and handed over as ``Quantized`` when the engine asks
for that. The layers are built side by side on the CPU's cores (``spread``).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import numpy as np

from ..blocks.codec import Block, convert
from ..errors import BlockDecodeError
from ..blocks.layers import KVLayer, Layer, Quantized, StateLayer, Tensor, take_rows
from .spread import spread


def assemble(blocks: list[Block], length: int, quantized: Optional[tuple[int, int]]) -> list[Layer]:
    """Per layer, the rows of ``[0, length)`` (or of the window) as one tensor."""
    used = [b for b in blocks if b is not None]
    starts = np.cumsum([0] + [len(b.tokens) for b in used])
    out: list[Optional[Layer]] = []
    work = []
    slots = []  # (index in out, first row, window) of each attention layer
    for li, proto in enumerate(used[-1].layers):
        if isinstance(proto, StateLayer) or (proto is None and _is_state_slot(used, li)):
            out.append(proto)
            continue
        window = next((b.layers[li].window for b in used if b.layers[li] is not None), None)
        lo = 0 if window is None else max(0, length - window)
        pieces = []
        for b, s in zip(used, starts):
            e = s + len(b.tokens)
            if e <= lo or s >= length:
                continue
            layer = b.layers[li]
            if layer is None or layer.start > max(lo, s):
                raise BlockDecodeError(f"layer {li} lacks rows its window needs")  # the index said otherwise
            pieces.append((layer, max(lo, s) - layer.start, min(length, e) - layer.start))
        work += [partial(_rows, pieces, "keys", quantized), partial(_rows, pieces, "values", quantized)]
        slots.append((len(out), lo, window))
        out.append(None)
    tensors = spread(work)  # the layers side by side on the CPU's cores
    for (i, lo, window), keys, values in zip(slots, tensors[::2], tensors[1::2]):
        out[i] = KVLayer(keys, values, lo, window)
    return out


def _rows(pieces: list[tuple[KVLayer, int, int]], which: str, quantized: Optional[tuple[int, int]]) -> Tensor:
    """One tensor of the given rows of each block's keys or values."""
    return _concat([take_rows(getattr(layer, which), a, z) for layer, a, z in pieces], quantized)


def _is_state_slot(blocks: list[Block], li: int) -> bool:
    return any(isinstance(b.layers[li], StateLayer) for b in blocks)


def _concat(pieces: list[Tensor], quantized: Optional[tuple[int, int]]) -> Tensor:
    if quantized is not None:
        bits, gs = quantized
        qs = [convert(p, bits, gs) for p in pieces]
        if all(isinstance(q, Quantized) and q.settings == qs[0].settings for q in qs):
            parts = [mx.concatenate([q.arrays()[i] for q in qs], axis=-2) for i in range(3)]
            return qs[0].with_arrays(*parts)
        pieces = qs  # head dim no group divides: stays dense
    if all(isinstance(p, Quantized) for p in pieces) and len({p.settings for p in pieces}) == 1:
        # dequantize (and unrotate) once over the whole prefix rather than per block
        parts = [mx.concatenate([p.arrays()[i] for p in pieces], axis=-2) for i in range(3)]
        return pieces[0].with_arrays(*parts).dequantize()
    dense = [p.dequantize() if isinstance(p, Quantized) else p for p in pieces]
    return dense[0] if len(dense) == 1 else mx.concatenate(dense, axis=-2)
