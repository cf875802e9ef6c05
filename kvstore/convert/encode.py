"""A put's rows cut into blocks, compressed (quantized, rotated) by the
codec and serialized, on the writer thread. On CUDA consecutive blocks laid
out alike are done together (``encoded``): a few large kernels per run of
blocks, not a few per block per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from ..gpu.backend import Backend, choose
from ..blocks.codec import Block, Codec, block_arrays
from ..blocks.hashing import narrowest
from ..blocks.layers import KVLayer, Layer, StateLayer, Tensor, take_rows
from ..blocks.wire import Stored

if TYPE_CHECKING:
    from ..state.index import BlockRef


@dataclass
class Rows:
    """Rows ``[start, stop)`` of one layer, compressed at once for the blocks inside them."""

    start: int
    stop: int
    keys: Tensor
    values: Tensor


def encoded(job, codec: Codec, compress_rows: int, wanted: Callable[[BlockRef], bool],
            together: Optional[bool] = None, backend: Optional[Backend] = None
            ) -> Iterator[tuple[BlockRef, Stored, "About"]]:
    """The job's blocks that ``wanted`` still wants (asked once each, once the
    blocks before it that cannot share its run are handed over), in order,
    each as its bytes and what its record says of it. ``together`` (default:
    on CUDA) encodes runs of consecutive blocks laid out alike, up to
    ``compress_rows`` rows, in one go: each layer's rows compressed at once,
    every array copied once into the run's payloads, one download per block.
    ``backend``: where the job's arrays live (default: ``choose()``)."""
    backend = backend or choose()
    if together is None:
        together = backend.apart
    run: list[BlockRef] = []
    for node in job.nodes:
        if run and not (together and _extends(job, run, node, compress_rows)):
            yield from _encoded_run(job, run, codec, compress_rows, backend)
            run = []
        if wanted(node):
            run.append(node)
        elif run:
            yield from _encoded_run(job, run, codec, compress_rows, backend)
            run = []
    yield from _encoded_run(job, run, codec, compress_rows, backend)


@dataclass(frozen=True)
class About:
    """What a block's record says of its contents (``BlockRecord``): how KV is
    kept, its dtype, and whether it holds a state snapshot. Handed on instead
    of the block, whose arrays (the engine's, or a run's) then go at once."""

    kv: str
    dtype: str
    has_state: bool

    @classmethod
    def of(cls, block: Block) -> "About":
        return cls(*block.describe(), any(isinstance(l, StateLayer) for l in block.layers))


def _extends(job, run: list[BlockRef], node: BlockRef, compress_rows: int) -> bool:
    """Whether ``node`` can join ``run``: next to it, as long, within
    ``compress_rows`` rows, and both laid out as every full block is."""
    return (node.start == run[-1].end and node.length == run[0].length
            and node.end - run[0].start <= max(compress_rows, 2 * node.length)
            and (len(run) > 1 or _plain(job, run[0])) and _plain(job, node))  # (a longer run is plain)


def _plain(job, node: BlockRef) -> bool:
    """Every attention layer holds all of the block's rows, no state is kept
    with it, and its ids are int32: what every block but a prompt's last (or
    a sliding window's first) looks like."""
    return (all(isinstance(l, KVLayer) and l.start <= node.start or isinstance(l, StateLayer)
                and node.end < len(job.tokens) for l in job.layers)
            and narrowest(job.tokens[node.start : node.end]).dtype == np.int32)


def _encoded_run(job, run: list[BlockRef], codec: Codec, compress_rows: int,
                 backend: Backend) -> Iterator[tuple[BlockRef, Stored, About]]:
    if len(run) == 1:
        block = encode(job, run[0], codec, compress_rows, backend)
        held, about = Stored.pack(block, run[0].key, run[0].start, backend), About.of(block)
        del block
        yield run[0], held, about
    elif run:
        s = run[0].start
        whole = _encode_rows(job, s, run[-1].end, codec, compress_rows, backend)
        first = _cut(whole, 0, run[0].length)  # (laid out as every block of the run: one plan, one About)
        about = About.of(first)
        held = Stored.pack_run(whole, first, [n.key for n in run], [n.start for n in run], backend)
        del whole, first  # (the run's arrays go once its payloads are made)
        for node in run:
            yield node, next(held), about


def _cut(whole: Block, a: int, b: int) -> Block:
    """Rows ``[a, b)`` of a run's block (views; laid out as a block of their own)."""
    return Block(whole.tokens[a:b].copy(),
                 [None if l is None else KVLayer(take_rows(l.keys, a, b), take_rows(l.values, a, b), l.start + a,
                                                  l.window) for l in whole.layers])


def encode(job, node: BlockRef, codec: Codec, compress_rows: int, backend: Optional[Backend] = None) -> Block:
    """The block's rows of every layer, compressed. Uncompressed rows stay
    views of the engine's buffers (the job holds those, so mlx never writes
    them in place): ``Stored.pack`` copies them once, straight into the
    block's bytes, and the views go with the ``Block`` right after."""
    return _encode_rows(job, node.start, node.end, codec, compress_rows, backend or choose())


def _encode_rows(job, s: int, e: int, codec: Codec, compress_rows: int, backend: Backend) -> Block:
    out: list[Optional[Layer]] = []
    windowed = any(isinstance(l, KVLayer) and l.window is not None for l in job.layers)
    for li, l in enumerate(job.layers):
        if isinstance(l, KVLayer):
            # a sliding-window layer may hold only the block's last rows
            first = s if l.start <= s else (l.start if l.window is not None and l.start < e else None)
            if first is None:
                out.append(None)
                continue
            k, v = _compressed_rows(job, li, l, first, e, codec.for_layer(l.window, windowed), compress_rows,
                                    backend.apart)
            out.append(KVLayer(k, v, first, l.window))
        else:
            out.append(StateLayer([None if a is None else mx.contiguous(a) for a in l.arrays])
                       if e == len(job.tokens) else None)
    block = Block(job.tokens[s:e].copy(), out)
    mx.eval(block_arrays(block))
    return block


def _compressed_rows(job, li: int, l: KVLayer, first: int, e: int, codec: Codec, compress_rows: int,
                     apart: bool) -> tuple[Tensor, Tensor]:
    """Rows ``[first, e)`` of layer ``li``, compressed. Quantizing (and
    rotating) works row by row, so on the host up to ``compress_rows`` rows
    are done in one go and later blocks are cut from them. Not where arrays
    live ``apart`` from the host (CUDA): there a block is laid out on the
    device from contiguous arrays, and each slice of a shared chunk would
    take a copy kernel of its own."""
    def compressed(a: int, b: int) -> tuple[Tensor, Tensor]:
        return (codec.compress_keys(take_rows(l.keys, a - l.start, b - l.start)),
                codec.compress_values(take_rows(l.values, a - l.start, b - l.start)))

    if (codec.key_bits is None and codec.value_bits is None) or apart:
        return compressed(first, e)
    got = job.compressed.get(li)
    if got is None or not (got.start <= first and e <= got.stop):
        stop = max(e, min(first + compress_rows, l.stop))
        got = job.compressed[li] = Rows(first, stop, *compressed(first, stop))
    return take_rows(got.keys, first - got.start, e - got.start), take_rows(got.values, first - got.start, e - got.start)
