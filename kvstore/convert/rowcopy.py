"""A hit moved into its per-layer GPU arrays (CUDA).

A block of plain attention layers holds, after its tokens, each layer's keys
then values as ``[1, heads, rows, dim]`` arrays one after the other: a run of
(layer, tensor, head) *lines* of ``rows * dim`` elements, evenly spaced. The
arrays the engine gets, ``[1, heads, length, dim]`` per layer and tensor, are
the same lines at a longer pitch. A quantized block is three such runs, one
per kind of array (data, scales, biases: ``wire`` lays its arrays out kind by
kind). So each block goes to where its rows belong with one strided copy
(``cudaMemcpy2DAsync``) per kind on the copy engine (one per array where its
arrays are not evenly spaced: a short last block, whose arrays are padded
apart, or an older block laid out layer by layer), and each kind is one
plain copy on the GPU from there, of which each layer's arrays are views (a
quantized hit is dequantized there in one kernel when the engine asks for
plain arrays).

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

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..gpu import cuda
from ..blocks.header import MX_OF
from ..blocks.layers import KVLayer, Quantized, dequantize
from .spread import each
from ..blocks.ondevice import DeviceBlock, HitArrays

_ALIGN = 256  # where each kind's lines start in the landing buffer


@dataclass(frozen=True)
class Lines:
    """How a hit's blocks lie: the quantization (``(bits, group size)``, or
    ``None``) and per kind of array its ``(dtype, heads, width)``."""

    q: Optional[tuple[int, int]]
    kinds: tuple[tuple[str, int, int], ...]

    @property
    def heads(self) -> int:
        return self.kinds[0][1]

    def line(self, c: int) -> int:
        """Bytes of one row of one head of kind ``c``."""
        name, _, width = self.kinds[c]
        return width * MX_OF[name].size


def lines(items: Sequence, spec: tuple) -> Optional[Lines]:
    """The ``Lines`` of blocks whose layers all hold their keys and values
    alike (plain, or quantized under one setting without rotation); else
    ``None``."""
    layouts = {entry for layer in spec for entry in layer}
    if len(layouts) != 1:
        return None
    ((q, r, kinds),) = layouts
    if r is not None or len({h for _, h, _ in kinds}) != 1:
        return None
    lay = Lines(q, kinds)
    for it in items:
        if isinstance(it, DeviceBlock):
            if it.arrays is None:  # (kept by the block-buffer path)
                return None
        elif any(it.header.ntokens * lay.line(c) > cuda.STAGE for c in range(len(kinds))):
            return None
    return lay


def _runs(item, c: int, n: int, width: int) -> list[tuple[int, int, int]]:
    """Where block ``item``'s lines of kind ``c`` (of ``n``) lie, ``width``
    bytes each: ``(payload offset, first line, lines)`` per evenly spaced
    run. One run where the kind's arrays lie one after the other (blocks
    written kind by kind, of rows that fill their alignment); else one per
    array (a short last block, or an older block laid out layer by layer)."""
    arrays = item.header.kv_arrays()[c::n]
    h = arrays[0].nbytes // width
    at = [a.offset for a in arrays]
    if at == list(range(at[0], at[0] + len(at) * h * width, h * width)):
        return [(at[0], 0, len(at) * h)]
    return [(o, t * h, h) for t, o in enumerate(at)]


def gather(items: Sequence, spans: Sequence[tuple[int, int]], lay: Lines, length: int,
           keep: bool, rt: cuda.Runtime) -> tuple[Optional[HitArrays], Optional[int], list]:
    """The hit's ``HitArrays``; the index of the first block whose checksum
    failed (``None``: all good); and with ``keep``, per block a
    ``DeviceBlock`` of its rows in those arrays. ``rt``: the copy engine."""
    on = items[0].arrays if isinstance(items[0], DeviceBlock) else None
    if on is not None and all(isinstance(it, DeviceBlock) and it.arrays is on for it in items):
        return on, None, [None] * len(items)  # kept as they are: no copy
    nlines = 2 * len(items[0].header.layers) * lay.heads
    pieces: list[list[mx.array]] = [[] for _ in lay.kinds]
    i = 0
    while i < len(items):
        if isinstance(items[i], DeviceBlock):  # rows already in GPU memory: sliced there
            j = device_run(items, i, lambda it: it.arrays)
            a, b = items[i].row, items[j - 1].row + items[j - 1].header.ntokens
            for p, x in zip(pieces, items[i].arrays.kinds):
                p.append(x[:, a:b])
        else:  # host blocks, as many as the landing buffer holds
            j, rows = _host_run(items, i, nlines, lay)
            bad = _land(items[i:j], [s - spans[i][0] for s, _ in spans[i:j]], rows, nlines, lay, pieces, rt)
            if bad is not None:
                return None, i + bad, []
        i = j
    out = HitArrays([p[0] if len(p) == 1 else mx.concatenate(p, axis=1) for p in pieces], lay.heads)
    mx.eval(out.kinds)
    kept: list = [None] * len(items)
    if keep:  # the next hit of these blocks gets views of these arrays
        kept = [DeviceBlock.kept(it, arrays=out, row=s) for it, (s, _) in zip(items, spans)]
    return out, None, kept


def device_run(items: Sequence, i: int, held_in: Callable[[DeviceBlock], object]) -> int:
    """The end of the run of device-tier blocks from ``i`` held in the same
    buffer (``held_in``): a block's place there is its place in the prompt,
    so consecutive blocks are consecutive rows there, cut at once."""
    on = held_in(items[i])
    j = i + 1
    while j < len(items) and isinstance(items[j], DeviceBlock) and held_in(items[j]) is on:
        j += 1
    return j


def _host_run(items: Sequence, i: int, nlines: int, lay: Lines) -> tuple[int, int]:
    """The end of the run of host blocks from ``i`` that one landing buffer
    holds (``cuda.LANDING``), and their rows."""
    row_bytes = nlines * sum(lay.line(c) for c in range(len(lay.kinds)))
    rows = items[i].header.ntokens
    j = i + 1
    while (j < len(items) and not isinstance(items[j], DeviceBlock)
           and (rows + items[j].header.ntokens) * row_bytes + _ALIGN * len(lay.kinds) <= cuda.LANDING):
        rows += items[j].header.ntokens
        j += 1
    return j, rows


def layers(hit: HitArrays, lay: Lines, length: int, quantized: bool) -> list[KVLayer]:
    """Rows ``[0, length)`` of every layer, as views of ``hit``; a quantized
    hit as ``Quantized`` where the engine asked for that (``quantized``),
    else dequantized at once, every layer in one kernel."""
    kinds = [x if x.shape[1] == length else x[:, :length] for x in hit.kinds]
    q = lay.q
    if q is not None and not quantized:
        kinds, q = [dequantize(*kinds, q[1], q[0])], None
    mx.eval(kinds)
    h = hit.heads
    tensors = [[x[t * h : (t + 1) * h][None] for x in kinds] for t in range(kinds[0].shape[0] // h)]
    tensors = [t[0] if q is None else Quantized(*t, q[0], q[1]) for t in tensors]
    return [KVLayer(tensors[i], tensors[i + 1], 0, None) for i in range(0, len(tensors), 2)]


def _land(items: Sequence, starts: Sequence[int], rows: int, nlines: int, lay: Lines, pieces: list,
          rt: cuda.Runtime) -> Optional[int]:
    """Host blocks to a landing buffer by strided copies (one per kind of
    array) on ``rt``'s copy engine, then copied out on the GPU, one new
    ``[lines, rows, width]`` array per kind appended to ``pieces``; the index
    of a block whose checksum failed, if any (nothing appended then)."""
    n = len(lay.kinds)
    line = [lay.line(c) for c in range(n)]
    pitch = [rows * b for b in line]
    region = [0]
    for c in range(n - 1):
        region.append(-(-(region[-1] + nlines * pitch[c]) // _ALIGN) * _ALIGN)
    with cuda.landing(region[-1] + nlines * pitch[-1]) as (buf, base):

        def send(c: int, src: int, spitch: int, first: int, count: int, row: int, stream) -> None:
            rt.copy2d(base + region[c] + first * pitch[c] + row * line[c], pitch[c], src, spitch, spitch, count,
                      stream)

        def runs(it) -> tuple[list[int], list[tuple[int, tuple[int, int, int]]]]:
            """A block's bytes per line of each kind, and its runs of lines: ``(kind, run)``."""
            width = [it.header.ntokens * b for b in line]
            return width, [(c, r) for c in range(n) for r in _runs(it, c, n, width[c])]

        def queue(k: int, stream) -> None:
            it = items[k]
            at = np.frombuffer(it.payload, np.uint8).ctypes.data
            width, block = runs(it)
            for c, (off, first, count) in block:
                send(c, at + off, width[c], first, count, starts[k], stream)

        def stage(k: int) -> None:
            it = items[k]
            width, block = runs(it)
            if len(block) > n and len(it.payload) <= cuda.STAGE:  # many small runs: the block staged once
                with cuda.staged(rt, it.payload) as (at, stream):
                    for c, (off, first, count) in block:
                        send(c, at + off, width[c], first, count, starts[k], stream)
                return
            for c, (off, first, count) in block:
                w = width[c]
                cuda.upload_lines(rt, it.payload[off : off + count * w], w,
                                  lambda at, f, m, stream, c=c, w=w, first=first: send(c, at, w, first + f, m,
                                                                                        starts[k], stream))

        bad = move_blocks(items, queue, stage, rt)
        if bad is not None:
            return bad
        new = [mx.array(buf[region[c] : region[c] + nlines * pitch[c]].view(MX_OF[name])
                        .reshape(nlines, rows, width)) for c, (name, _, width) in enumerate(lay.kinds)]
        mx.eval(new)  # copied out before the buffer is used again
    for p, x in zip(pieces, new):
        p.append(x)
    return None


def move_blocks(items: Sequence, queue: Callable[[int, object], None], stage: Callable[[int], None],
                rt: cuda.Runtime) -> Optional[int]:
    """Host blocks to the GPU: RAM's (page-locked, checked) queued on one
    stream of ``rt`` back to back (``queue(k, stream)``, one task: the copy
    engine never idles between them), LMDB's pages checked and staged block by block
    on the other threads meanwhile (``stage(k)``). The index of the first
    block whose checksum failed, if any."""
    pinned = [it.checked and cuda.is_pinned(it.buf) for it in items]
    staged = [k for k, p in enumerate(pinned) if not p]

    def move(task: int) -> bool:
        if task == 0:
            with cuda.one_stream(rt) as stream:
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
