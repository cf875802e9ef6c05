"""A dense hit moved into its per-layer GPU arrays (CUDA).

A block of plain attention layers holds, after its tokens, each layer's keys
then values as ``[1, heads, rows, dim]`` arrays one after the other: a run of
(layer, tensor, head) *lines* of ``rows * dim`` elements, evenly spaced. The
arrays the engine gets, ``[1, heads, length, dim]`` per layer and tensor, are
the same lines at a longer pitch. So each block goes to where its rows belong
in every tensor with one strided copy (``cudaMemcpy2DAsync``) on the copy
engine, and each tensor is one plain copy on the GPU from there.

That copy is there because of where the copy engine can write. mlx keeps
what its kernels make in device memory, and the first time an array's
address is taken it moves the array into managed memory with a copy, which
costs about as much as the transfer (docs/benchmarks.md, "The hot path at
the bus"). So blocks land in a buffer kept for that (``cuda.landing``), as many
at a time as it holds, and the arrays handed over are new ones made from it
on the GPU, whose addresses nobody takes.

The device tier keeps those arrays (``HitArrays``): a later hit of the same
blocks at the same rows gets views of them, no copy; blocks held there for
other hits are sliced from theirs on the GPU.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..gpu import cuda
from ..blocks.layers import take_rows
from .spread import each
from ..blocks.ondevice import DeviceBlock, HitArrays


def dense(items: Sequence, spec: tuple) -> Optional[tuple[str, int, int]]:
    """``(dtype, heads, dim)`` where every layer holds its keys and values as
    one plain array each, all alike, and each block's arrays lie one after
    the other (its lines evenly spaced); else ``None``."""
    kinds = {arrays for layer in spec for _, _, arrays in layer}
    if len(kinds) != 1 or any(q is not None or r is not None for layer in spec for q, r, _ in layer):
        return None
    (kind,) = kinds
    if len(kind) != 1:
        return None
    for it in items:
        if isinstance(it, DeviceBlock):
            if it.arrays is None:  # (kept by the block-buffer path)
                return None
            continue
        offsets = [a.offset for a in it.header.kv_arrays()]
        size = it.header.layers[0].keys.arrays[0].nbytes
        if size // kind[0][1] > cuda.STAGE or offsets != list(range(offsets[0], offsets[0] + len(offsets) * size, size)):
            return None
    return kind[0]


def gather(items: Sequence, spans: Sequence[tuple[int, int]], kind: tuple[str, int, int], dtype: mx.Dtype,
           length: int, keep: bool) -> tuple[list, Optional[int], list]:
    """Per layer, per tensor, ``[array]`` of rows ``[0, length)``; the index of
    the first block whose checksum failed (``None``: all good); and with
    ``keep``, per block a ``DeviceBlock`` of its rows in those arrays."""
    _, heads, dim = kind
    tensors = 2 * len(items[0].header.layers)
    on = items[0].arrays if isinstance(items[0], DeviceBlock) else None
    if on is not None and all(isinstance(it, DeviceBlock) and it.arrays is on for it in items):
        return _layers(on.tensors, length), None, [None] * len(items)  # kept as they are: no copy
    line = dim * dtype.size  # bytes of one row of one head
    pieces: list[list[mx.array]] = [[] for _ in range(tensors)]
    i = 0
    while i < len(items):
        j = i + 1
        if isinstance(items[i], DeviceBlock):  # rows already in GPU memory: sliced there
            while j < len(items) and isinstance(items[j], DeviceBlock) and items[j].arrays is items[i].arrays:
                j += 1  # (a block's row there is its place in the prompt: consecutive blocks, consecutive rows)
            a, b = items[i].row, items[j - 1].row + items[j - 1].header.ntokens
            for p, x in zip(pieces, items[i].arrays.tensors):
                p.append(take_rows(x, a, b))
        else:  # host blocks, as many as the landing buffer holds
            rows = items[i].header.ntokens
            while (j < len(items) and not isinstance(items[j], DeviceBlock)
                   and (rows + items[j].header.ntokens) * tensors * heads * line <= cuda.LANDING):
                rows += items[j].header.ntokens
                j += 1
            bad = _land(items[i:j], [s - spans[i][0] for s, _ in spans[i:j]], rows, tensors * heads, line, dtype,
                        pieces)
            if bad is not None:
                return [], i + bad, []
        i = j
    out = HitArrays([p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for p in pieces])
    mx.eval(out.tensors)
    kept: list = [None] * len(items)
    if keep:  # the next hit of these blocks gets views of these arrays
        kept = [DeviceBlock.kept(it, arrays=out, row=s) for it, (s, _) in zip(items, spans)]
    return _layers(out.tensors, length), None, kept


def _land(items: Sequence, starts: Sequence[int], rows: int, nlines: int, line: int, dtype: mx.Dtype,
          pieces: list) -> Optional[int]:
    """Host blocks to a landing buffer by strided copies, then copied out on
    the GPU, one new array per tensor appended to ``pieces``; the index of a
    block whose checksum failed, if any (nothing appended then)."""
    rt = cuda.runtime()
    pitch = rows * line
    with cuda.landing(nlines * pitch) as (buf, base):

        def send(src: int, spitch: int, first: int, count: int, row: int, stream) -> None:
            rt.copy2d(base + first * pitch + row * line, pitch, src, spitch, spitch, count, stream)

        def queue(k: int, stream) -> None:
            it = items[k]
            src = np.frombuffer(it.payload, np.uint8).ctypes.data + it.header.kv_arrays()[0].offset
            send(src, it.header.ntokens * line, 0, nlines, starts[k], stream)

        def stage(k: int) -> None:
            it = items[k]
            width, off = it.header.ntokens * line, it.header.kv_arrays()[0].offset
            cuda.upload_lines(rt, it.payload[off : off + nlines * width], width,
                              lambda at, first, n, stream: send(at, width, first, n, starts[k], stream))

        bad = move_blocks(items, queue, stage)
        if bad is not None:
            return bad
        heads = nlines // len(pieces)
        landed = buf[: nlines * pitch].view(dtype).reshape(nlines, rows, line // dtype.size)
        new = [mx.array(landed[t * heads : (t + 1) * heads])[None] for t in range(len(pieces))]
        mx.eval(new)  # copied out before the buffer is used again
    for p, x in zip(pieces, new):
        p.append(x)
    return None


def move_blocks(items: Sequence, queue: Callable[[int, object], None], stage: Callable[[int], None]) -> Optional[int]:
    """Host blocks to the GPU: RAM's (page-locked, checked) queued on one
    stream back to back (``queue(k, stream)``, one task: the copy engine
    never idles between them), LMDB's pages checked and staged block by block
    on the other threads meanwhile (``stage(k)``). The index of the first
    block whose checksum failed, if any."""
    pinned = [it.checked and cuda.is_pinned(it.buf) for it in items]
    staged = [k for k, p in enumerate(pinned) if not p]

    def move(task: int) -> bool:
        if task == 0:
            with cuda.one_stream(cuda.runtime()) as stream:
                for k in (k for k, p in enumerate(pinned) if p):
                    queue(k, stream)
            return True
        k = staged[task - 1]
        if not items[k].intact():
            return False
        stage(k)
        return True

    ok = each(move, len(staged) + 1)[1:]
    return next((k for k, good in zip(staged, ok) if not good), None)


def _layers(tensors: list[mx.array], length: int) -> list:
    """Per layer, ``[[keys], [values]]``: rows ``[0, length)`` of ``tensors`` (views)."""
    cut = [x if x.shape[2] == length else take_rows(x, 0, length) for x in tensors]
    mx.eval(cut)
    return [[[cut[2 * li]], [cut[2 * li + 1]]] for li in range(len(cut) // 2)]
