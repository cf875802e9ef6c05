"""A put's rows cut into blocks and compressed (quantized, rotated) by the
codec, on the writer thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import cuda
from .codec import Block, Codec, block_arrays
from .index import Node
from .layers import KVLayer, Layer, StateLayer, Tensor, take_rows, tensor_rows


@dataclass
class Rows:
    """Rows ``[start, stop)`` of one layer, compressed at once for the blocks inside them."""

    start: int
    stop: int
    keys: Tensor
    values: Tensor


def encode(job, node: Node, codec: Codec, compress_rows: int) -> Block:
    """The block's rows of every layer, compressed. Uncompressed rows stay
    views of the engine's buffers (the job holds those, so mlx never writes
    them in place): ``Stored.pack`` copies them once, straight into the
    block's bytes, and the views go with the ``Block`` right after."""
    s, e = node.start, node.end
    out: list[Optional[Layer]] = []
    windowed = any(isinstance(l, KVLayer) and l.window is not None for l in job.layers)
    for li, l in enumerate(job.layers):
        if isinstance(l, KVLayer):
            # a sliding-window layer may hold only the block's last rows
            first = s if l.start <= s else (l.start if l.window is not None and l.start < e else None)
            if first is None:
                out.append(None)
                continue
            k, v = _compressed_rows(job, li, l, first, e, codec.for_layer(l.window, windowed), compress_rows)
            out.append(KVLayer(k, v, first, l.window))
        else:
            out.append(StateLayer([None if a is None else mx.contiguous(a) for a in l.arrays])
                       if e == len(job.tokens) else None)
    block = Block(job.tokens[s:e].copy(), out)
    mx.eval(block_arrays(block))
    return block


def _compressed_rows(job, li: int, l: KVLayer, first: int, e: int, codec: Codec, compress_rows: int
                     ) -> tuple[Tensor, Tensor]:
    """Rows ``[first, e)`` of layer ``li``, compressed. Quantizing (and
    rotating) works row by row, so on the host up to ``compress_rows`` rows
    are done in one go and later blocks are cut from them. Not on CUDA: there
    a block is laid out on the device from contiguous arrays, and each slice
    of a shared chunk would take a copy kernel of its own."""
    def compressed(a: int, b: int) -> tuple[Tensor, Tensor]:
        return (codec.compress_keys(take_rows(l.keys, a - l.start, b - l.start)),
                codec.compress_values(take_rows(l.values, a - l.start, b - l.start)))

    if (codec.key_bits is None and codec.value_bits is None) or cuda.runtime() is not None:
        return compressed(first, e)
    got = job.compressed.get(li)
    if got is None or not (got.start <= first and e <= got.stop):
        stop = max(e, min(first + compress_rows, l.start + tensor_rows(l.keys)))
        got = job.compressed[li] = Rows(first, stop, *compressed(first, stop))
    return take_rows(got.keys, first - got.start, e - got.start), take_rows(got.values, first - got.start, e - got.start)
