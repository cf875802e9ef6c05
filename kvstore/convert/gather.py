"""A hit's blocks to one tensor per layer, with one copy of each stored byte.

Every tier hands over a block as ``Stored``, its serialized bytes with the
header checked: from RAM (bytes this process holds, checksum known good) or
from disk (as LMDB maps them, valid inside the read transaction, payload not
checked yet). Where every block holds full rows of plain
attention layers under one setting (the common case), the hit is built in
one pass over the bytes, blocks side by side on a thread pool, each block's
checksum verified by the thread that moves it:

- **host memory** (the CPU, Apple silicon): each block's rows are copied from
  the mapped pages straight into the final per-layer arrays;
- **CUDA** (mlx has no host->device copy): blocks land on the copy engine in
  a reused buffer (``cuda.landing``) and the arrays handed over are copied
  out of it on the GPU. Blocks laid out kind by kind (plain or quantized
  under one setting: what ``wire`` writes) land at their rows of every
  tensor by strided copies (``kvstore.convert.rowcopy``); older layouts land block by
  block and are cut there (``kvstore.convert.landing``): blocks of one layout are a
  ``[blocks, bytes]`` matrix whose column ranges are one layer's arrays, so one strided
  view per layer and part replaces a concatenation of per-block pieces. Pageable bytes
  (LMDB's pages) go through pinned staging buffers (``kvstore.gpu.cuda``).

Quantized parts are assembled before anything is dequantized.
Anything else (state snapshots, sliding windows, mixed settings, an engine
asking for other quantization) is decoded block by block for ``assemble``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
import xxhash

from ..gpu.backend import Backend, choose
from . import landing, rowcopy
from .landing import stored_arrays
from .assemble import assemble
from ..blocks.codec import Block
from ..errors import BlockDecodeError
from ..blocks.header import KVSpec
from ..blocks.layers import KVLayer, Layer, Quantized
from .spread import each, spread
from ..blocks.ondevice import DeviceBlock
from ..blocks.wire import Stored

_DTYPE = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32, "uint32": mx.uint32}


@dataclass
class Gathered:
    """Layers of ``[0, length)``; or, when a block failed its checksum, no
    layers and ``bad``, its index (the caller serves the blocks before it).
    ``on_device``: with ``keep_on_device``, a device copy of each block this
    hit moved to the GPU (for the device tier)."""

    layers: list[Optional[Layer]]
    length: int
    bad: Optional[int] = None
    on_device: list = field(default_factory=list)


# ------------------------------------------------------------------ layout


def _spec(item: Stored) -> Optional[tuple]:
    """Per layer, the settings and per-array (dtype, heads, width) of a block
    of full-row attention layers; ``None`` when the fast path cannot take it."""
    return _layout(item.header.ntokens, item.header.layers)


@lru_cache(maxsize=64)
def _layout(n: int, layers: tuple) -> Optional[tuple]:
    # once per byte layout, not per block (blocks of a hit share one): walking a layer table in Python costs
    # several times what hashing it does, and a remote hit asks as each block is placed and again for the hit
    out = []
    for e in layers:
        if not isinstance(e, KVSpec) or e.window is not None or e.row_offset != 0:
            return None
        ts = []
        for t in (e.keys, e.values):
            if any(len(a.shape) != 4 or a.shape[0] != 1 or a.shape[2] != n or a.dtype not in _DTYPE
                   for a in t.arrays):
                return None
            ts.append((None if t.bits is None else (t.bits, t.group_size), t.rotation,
                       tuple((a.dtype, a.shape[1], a.shape[3]) for a in t.arrays)))
        out.append(tuple(ts))
    return tuple(out)


def _fast_spec(items: Sequence[Stored], quantized: Optional[tuple[int, int]]) -> Optional[tuple]:
    specs = {_spec(it) for it in items}
    if len(specs) != 1:
        return None
    spec = specs.pop()
    if spec is None or not spec:
        return None
    if quantized is not None:  # handed over as they are, or not at all here
        if any(q != tuple(quantized) or r is not None for layer in spec for q, r, _ in layer):
            return None
    return spec


def gather(items: Sequence, length: int, quantized: Optional[tuple[int, int]] = None,
           keep_on_device: bool = False, fill: Optional[HostFill] = None,
           backend: Optional[Backend] = None) -> Gathered:
    """One tensor per layer (``Quantized`` when the engine asks for the stored
    settings) for rows ``[0, length)`` of consecutive blocks from position 0
    (``Stored`` bytes, or ``DeviceBlock``s already in GPU memory). ``fill``:
    destinations some of these blocks were placed in already (used when
    they are this hit's). ``backend``: where the arrays go (default: ``choose()``)."""
    spans = []  # per block used: (first row, rows used)
    pos = 0
    for it in items:
        if pos >= length:
            break
        n = it.header.ntokens
        spans.append((pos, min(n, length - pos)))
        pos += n
    items = items[: len(spans)]
    spec = _fast_spec(items, quantized)
    if spec is None:
        return _slow(items, length, quantized)
    kept: list = []
    backend = backend or choose()
    lay = rowcopy.lines(items, spec) if backend.apart else None
    if lay is not None:
        hit, bad, kept = rowcopy.gather(items, spans, lay, length, keep_on_device, backend.runtime)
        if bad is not None:
            return Gathered([], 0, bad)
        return Gathered(rowcopy.layers(hit, lay, length, quantized is not None), length, on_device=kept)
    if any(isinstance(it, DeviceBlock) and it.arrays is not None for it in items):
        return _slow(items, length, quantized)  # (a host block laid out otherwise beside them)
    elif backend.apart:
        parts, bad, kept = landing.fill(items, spans, spec, length, keep_on_device, backend)
    else:
        parts, bad = _fill_host(items, spans, spec, length, fill)
    if bad is not None:
        return Gathered([], 0, bad)
    tensors: list[list] = []
    dense: list[tuple[int, int, Quantized]] = []  # dequantized below, for an engine that asked for dense arrays
    for layer, lspec in zip(parts, spec):
        row: list = []
        for arrays, (q, r, _) in zip(layer, lspec):
            if q is None:
                row.append(arrays[0])
            else:
                t = Quantized(*arrays, q[0], q[1], r)
                if quantized is None:
                    dense.append((len(tensors), len(row), t))
                row.append(t)
        tensors.append(row)
    # layers side by side on the CPU's cores, and evaluated here like every other array a fetch returns
    # (left lazy, the engine's first step would pay for it on one core, and the fetch's measured rate would
    # leave it out)
    for (li, ti, _), d in zip(dense, spread([t.dequantize for _, _, t in dense])):
        tensors[li][ti] = d
    return Gathered(KVLayer.many(tensors), length, on_device=kept)


def _slow(items: Sequence[Stored], length: int, quantized) -> Gathered:
    """Decode block by block (checksums included) and concatenate."""
    blocks: list[Block] = []
    for i, it in enumerate(items):
        try:
            blocks.append((it.to_stored() if isinstance(it, DeviceBlock) else it).decode())
        except BlockDecodeError:
            return Gathered([], 0, i)
    return Gathered(assemble(blocks, length, quantized), length)


# ------------------------------------------------------------- host memory


def _np(a: mx.array) -> np.ndarray:
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _zeros(spec, length: int) -> list:
    """Per layer, per tensor, the destination arrays, made on the worker
    threads: mlx has no uninitialized allocation, and zero-filling (on a
    Linux CPU, faulting in) new memory on one core was a third of a
    page-cached fetch on the 2-core box."""
    def layer(li: int) -> list:
        out = [[mx.zeros((1, h, length, w), _DTYPE[name]) for name, h, w in arrays] for _, _, arrays in spec[li]]
        mx.eval([a for t in out for a in t])
        return out

    return each(layer, len(spec))


class HostFill:
    """The destination arrays of a host-memory hit, filled block by block. A
    remote hit starts one as its first block arrives (``start``) and places
    each block as it comes in, while the next is on the wire; ``gather``
    then moves only what was not placed."""

    def __init__(self, spec: tuple, length: int):
        self.spec = spec
        self.length = length
        self.dests = _zeros(spec, length)
        # writable, the arrays' memory, as [heads, rows, width]
        self.views = [[[_np(a)[0] for a in t] for t in layer] for layer in self.dests]
        self.placed: dict[int, object] = {}  # first row -> the item whose rows are there

    def place(self, item: Stored, start: int) -> bool:
        """Move ``item``'s rows to ``start``; False (nothing kept) when they
        do not fit or its checksum fails."""
        rows = min(item.header.ntokens, self.length - start)
        if rows <= 0 or _spec(item) != self.spec or not self.move(item, start, rows):
            return False
        self.placed[start] = item
        return True

    def move(self, item: Stored, s: int, n: int) -> bool:
        payload = item.payload
        placed = sorted(((dst, a) for lv, la in zip(self.views, stored_arrays(item)) for tv, ta in zip(lv, la)
                         for dst, a in zip(tv, ta)), key=lambda p: p[1].offset)
        # the checksum is taken array by array as each is copied, in the payload's order, while its bytes
        # are in the cache (one read of the mapped pages instead of two)
        h = None if item.checked else xxhash.xxh3_64()
        pos = 0
        for dst, a in placed:
            end = a.offset + a.nbytes
            if h is not None and end > pos:  # every payload byte hashed once, in order
                h.update(payload[pos:end])
                pos = end
            _, heads, rows, width = a.shape
            t = a.np_dtype
            # one call per array (not a view, a reshape and two slices): a block has hundreds of them
            dst[:, s : s + n] = np.ndarray((heads, n, width), t, payload, a.offset,
                                           (rows * width * t.itemsize, width * t.itemsize, t.itemsize))
        if h is not None:
            h.update(payload[pos:])
            return h.intdigest() == item.header.checksum  # a bad block's rows are never served
        return True


def start(first: Stored, length: int, quantized: Optional[tuple[int, int]],
          backend: Optional[Backend] = None) -> Optional[HostFill]:
    """A fill for a hit of ``length`` rows of blocks laid out like ``first``
    (``None`` where ``gather`` would not fill host arrays: a device apart
    (CUDA), other layouts). ``backend``: default ``choose()``."""
    spec = None if (backend or choose()).apart else _fast_spec([first], quantized)
    return None if spec is None else HostFill(spec, length)


def _fill_host(items, spans, spec, length, fill: Optional[HostFill]):
    if fill is None or fill.spec != spec or fill.length != length:
        fill = HostFill(spec, length)
    todo = [i for i, (s, _) in enumerate(spans) if fill.placed.get(s) is not items[i]]
    ok = each(lambda k: fill.move(items[todo[k]], *spans[todo[k]]), len(todo))
    bad = next((i for i, good in zip(todo, ok) if not good), None)
    return fill.dests, bad
