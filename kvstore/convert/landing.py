"""Blocks that ``rowcopy``'s strided copies do not take (rotated 4-bit
keys, layouts other than ``wire``'s kind by kind, mixed settings) moved to
the GPU for ``gather`` (CUDA): host blocks land as many at a time as a
landing buffer holds, and each run of blocks of one byte layout is cut into
its layers there; blocks in the device tier are cut from its buffers."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..blocks.header import MX_OF, ArraySpec
from ..blocks.ondevice import DeviceBlock
from ..blocks.wire import Stored
from ..gpu import cuda
from ..gpu.backend import Backend
from . import rowcopy


def stored_arrays(item) -> list[list[tuple[ArraySpec, ...]]]:
    """Per layer, per tensor, where each of a block's arrays lies."""
    return [[e.keys.arrays, e.values.arrays] for e in item.header.layers]


def fill(items: Sequence, spans: Sequence[tuple[int, int]], spec: tuple, length: int, keep_on_device: bool,
         backend: Backend) -> tuple[list, Optional[int], list]:
    """Blocks of other layouts (quantized) to per-layer GPU arrays: host
    blocks land as many at a time as a landing buffer holds (``cuda.landing``:
    an array mlx made fresh would be moved into managed memory, with a copy,
    the first time its address is taken), on ``backend``'s copy engine, and
    each run of blocks is cut into its layers there, on the GPU; blocks in
    the device tier are cut from its buffers. The device tier keeps a device
    copy of what landed."""
    pieces: list[list[list[list[mx.array]]]] = [[[[] for _ in t[2]] for t in layer] for layer in spec]
    kept: list = [None] * len(items)
    i = 0
    while i < len(items):
        if isinstance(items[i], DeviceBlock):
            j = rowcopy.device_run(items, i, lambda it: it.data)
            _cut(items[i:j], spans[i:j], items[i].data, [it.offset for it in items[i:j]], pieces, False)
        else:
            j, offsets, size = _host_run(items, i)
            bad, kept[i:j] = _landed(items[i:j], spans[i:j], offsets, size, pieces, keep_on_device,
                                     backend.runtime)
            if bad is not None:
                return [], i + bad, []
        i = j
    out = [[[p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for p in tp] for tp in lp] for lp in pieces]
    mx.eval([a for lp in out for tp in lp for a in tp])
    return out, None, kept


def _host_run(items: Sequence, i: int) -> tuple[int, list[int], int]:
    """The end of the run of host blocks from ``i`` that one landing buffer
    holds (``cuda.LANDING``), where each lies in it (64-byte aligned) and
    the bytes they take."""
    offsets, size = [0], _padded(items[i])
    j = i + 1
    while j < len(items) and not isinstance(items[j], DeviceBlock) and size + _padded(items[j]) <= cuda.LANDING:
        offsets.append(size)
        size += _padded(items[j])
        j += 1
    return j, offsets, size


def _padded(item: Stored) -> int:
    return -(-len(item.payload) // 64) * 64


def _landed(items: Sequence[Stored], spans: Sequence[tuple[int, int]], offsets: list[int], size: int,
            pieces: list, keep_on_device: bool, rt: cuda.Runtime) -> tuple[Optional[int], list]:
    """Host blocks landed in a landing buffer at ``offsets`` (``size`` bytes
    in all) and cut into ``pieces``: the index of the first block whose
    checksum failed, if any (nothing cut then), and with ``keep_on_device``
    per block its ``DeviceBlock`` in a device copy of the buffer."""
    with cuda.landing(size) as (buf, base):
        bad = _land(items, offsets, base, rt)
        if bad is not None:
            return bad, []
        data = mx.array(buf[:size]) if keep_on_device else buf[:size]  # the device tier's: a copy of its own
        new = _cut(items, spans, data, offsets, pieces, not keep_on_device)
        mx.eval(new + [data])  # done with the landing buffer before it is used again
    if not keep_on_device:
        return None, [None] * len(items)
    return None, [DeviceBlock.kept(it, data=data, offset=o) for it, o in zip(items, offsets)]


def _land(items: Sequence[Stored], offsets: Sequence[int], base: int, rt: cuda.Runtime) -> Optional[int]:
    """Host blocks to GPU address ``base`` + their offsets on ``rt``'s copy
    engine (``rowcopy.move_blocks``); the index of the first block whose
    checksum failed, if any."""

    def queue(k: int, stream) -> None:
        a = np.frombuffer(items[k].payload, np.uint8)
        rt.copy(base + offsets[k], a.ctypes.data, len(a), stream)

    return rowcopy.move_blocks(items, queue, lambda k: cuda.upload(rt, base + offsets[k], items[k].payload), rt)


def _cut(items: Sequence, spans: Sequence[tuple[int, int]], data: mx.array, offsets: Sequence[int], pieces: list,
         own: bool) -> list[mx.array]:
    """Each run of consecutive blocks of one byte layout in ``data`` (uint8,
    a block at each offset) cut into its layers as a strided matrix, per
    array appended to ``pieces`` (a copy on the GPU where ``own``); returns
    the pieces appended."""
    views: dict[str, mx.array] = {}  # the buffer as each dtype its arrays have
    new: list[mx.array] = []
    i = 0
    while i < len(items):
        item = items[i]
        j = i + 1
        size = _payload_size(item)
        while (j < len(items) and _payload_size(items[j]) == size and size % 64 == 0
               and items[j].header.layers == item.header.layers and offsets[j] - offsets[j - 1] == size):
            j += 1
        m = j - i
        rows = sum(n for _, n in spans[i:j])
        stride = -(-size // 64) * 64
        for lp, la in zip(pieces, stored_arrays(item)):
            for tp, ta in zip(lp, la):
                for p, a in zip(tp, ta):
                    isz = a.np_dtype.itemsize
                    o = offsets[i]
                    if a.dtype not in views:
                        views[a.dtype] = data.view(MX_OF[a.dtype])
                    flat = views[a.dtype][o // isz : (o + m * stride) // isz]
                    x = flat.reshape(m, stride // isz)[:, a.offset // isz : (a.offset + a.nbytes) // isz]
                    _, h, r, w = a.shape
                    x = x.reshape(m, h, r, w).transpose(1, 0, 2, 3).reshape(1, h, m * r, w)[..., :rows, :]
                    p.append(mx.array(x) if own else x)
                    new.append(p[-1])
        i = j
    return new


def _payload_size(item) -> int:
    return item.size if isinstance(item, DeviceBlock) else len(item.payload)
