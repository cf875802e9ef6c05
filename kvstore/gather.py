"""A hit's blocks to one tensor per layer, with one copy of each stored byte.

Blocks come from RAM (``Block``: mlx arrays) or from disk (``Stored``: the
block's bytes as LMDB maps them, valid inside the read transaction, header
checked, payload not yet). Where every block holds full rows of plain
attention layers under one setting (the common case), the hit is built in
one pass over the bytes, blocks side by side on a thread pool, each block's
checksum verified by the thread that moves it:

- **host memory** (the CPU, Apple silicon): each block's rows are copied from
  the mapped pages straight into the final per-layer arrays;
- **CUDA** (mlx keeps arrays in managed memory and has no host->device copy):
  each block's bytes go through a pinned staging buffer to one device buffer
  on the copy engine (``kvstore.cuda``), and the layers are cut out of it on
  the GPU. Blocks of one layout are a ``[blocks, bytes]`` matrix whose column
  ranges are one layer's arrays, so one strided view per layer and part
  replaces a concatenation of per-block pieces.

Quantized parts are assembled per layer before anything is dequantized.
Anything else (state snapshots, sliding windows, mixed settings, an engine
asking for other quantization) is decoded block by block for ``assemble``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx
import numpy as np
import xxhash

from . import cuda
from .assemble import assemble
from .codec import Block, Stored, np_dtype
from .errors import BlockDecodeError
from .layers import KVLayer, Layer, Quantized
from .spread import each, spread

_DEVICE_BUF = 1 << 30  # bytes per device buffer blocks are copied into
_DTYPE = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32, "uint32": mx.uint32}


Item = Union[Block, Stored]


@dataclass
class Gathered:
    """Layers of ``[0, length)``; or, when a block failed its checksum, no
    layers and ``bad``, its index (the caller serves the blocks before it)."""

    layers: list[Optional[Layer]]
    length: int
    bad: Optional[int] = None


# ------------------------------------------------------------------ layout


def _spec(item: Item) -> Optional[tuple]:
    """Per layer, the settings and per-array (dtype, heads, width) of a block
    of full-row attention layers; ``None`` when the fast path cannot take it."""
    out = []
    if isinstance(item, Stored):
        n = item.header.ntokens
        for e in item.header.layers:
            if e is None or "s" in e or e.get("w") is not None or e.get("o", 0) != 0:
                return None
            ts = []
            for t in (e["k"], e["v"]):
                arrays = t["a"] if "q" in t else [t["a"]]
                if any(d[1][-2] != n or len(d[1]) != 4 or d[1][0] != 1 for d in arrays):
                    return None
                ts.append((tuple(t["q"]) if "q" in t else None, t.get("r"),
                           tuple((d[0], d[1][1], d[1][3]) for d in arrays)))
            out.append(tuple(ts))
        return tuple(out)
    n = len(item.tokens)
    for layer in item.layers:
        if not isinstance(layer, KVLayer) or layer.window is not None:
            return None
        ts = []
        for t in (layer.keys, layer.values):
            q = isinstance(t, Quantized)
            arrays = t.arrays() if q else (t,)
            if any(a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != n for a in arrays):
                return None
            if any(str(a.dtype).split(".")[-1] not in _DTYPE for a in arrays):
                return None
            ts.append(((t.bits, t.group_size) if q else None, t.rotation if q else None,
                       tuple((str(a.dtype).split(".")[-1], a.shape[1], a.shape[3]) for a in arrays)))
        out.append(tuple(ts))
    return tuple(out)


def _fast_spec(items: Sequence[Item], quantized: Optional[tuple[int, int]]) -> Optional[tuple]:
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


def gather(items: Sequence[Item], length: int, quantized: Optional[tuple[int, int]] = None) -> Gathered:
    """One tensor per layer (``Quantized`` when the engine asks for the stored
    settings) for rows ``[0, length)`` of consecutive blocks from position 0."""
    spans = []  # per block used: (first row, rows used)
    pos = 0
    for it in items:
        if pos >= length:
            break
        n = it.header.ntokens if isinstance(it, Stored) else len(it.tokens)
        spans.append((pos, min(n, length - pos)))
        pos += n
    items = items[: len(spans)]
    spec = _fast_spec(items, quantized)
    if spec is None:
        return _slow(items, length, quantized)
    rt = cuda.runtime()
    parts, bad = (_fill_device if rt is not None else _fill_host)(items, spans, spec, length)
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
    return Gathered([KVLayer(k, v, 0, None) for k, v in tensors], length)


def _slow(items: Sequence[Item], length: int, quantized) -> Gathered:
    """Decode block by block (checksums included) and concatenate."""
    blocks: list[Block] = []
    for i, it in enumerate(items):
        if isinstance(it, Stored):
            try:
                it = it.decode()
            except BlockDecodeError:
                return Gathered([], 0, i)
        blocks.append(it)
    return Gathered(assemble(blocks, length, quantized), length)


# ------------------------------------------------------------- host memory


def _np(a: mx.array) -> np.ndarray:
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _stored_arrays(item: Stored) -> list:
    """Per layer, per tensor, the (dtype, shape, offset, bytes) of each array."""
    return [[t["a"] if "q" in t else [t["a"]] for t in (e["k"], e["v"])] for e in item.header.layers]


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


def _fill_host(items, spans, spec, length):
    dests = _zeros(spec, length)
    views = [[[_np(a) for a in t] for t in layer] for layer in dests]  # writable: the arrays' own memory

    def move(i: int) -> bool:
        item, (s, n) = items[i], spans[i]
        if isinstance(item, Stored):
            payload = item.payload
            placed = [(dst, a) for lv, la in zip(views, _stored_arrays(item)) for tv, ta in zip(lv, la)
                      for dst, a in zip(tv, ta)]
            # the checksum is taken array by array as each is copied, while its bytes are in the cache
            # (one read of the mapped pages instead of two), where the arrays lie in the payload's order
            offsets = [a[2] for _, a in placed]
            h = xxhash.xxh3_64() if not item.checked and offsets == sorted(offsets) else None
            if h is None and not item.intact():
                return False
            pos = 0
            for dst, (name, shape, off, nb) in placed:
                if h is not None and off + nb > pos:  # every payload byte hashed once, in order
                    h.update(payload[pos : off + nb])
                    pos = off + nb
                src = np.frombuffer(payload, np_dtype(name), nb // np_dtype(name).itemsize, off)
                np.copyto(dst[0, :, s : s + n], src.reshape(shape)[0, :, :n])
            if h is not None:
                h.update(payload[pos:])
                return h.intdigest() == item.header.fields["sum"]  # a bad block's rows are never served
        else:
            for lv, layer in zip(views, item.layers):
                for tv, t in zip(lv, (layer.keys, layer.values)):
                    for dst, a in zip(tv, t.arrays() if isinstance(t, Quantized) else (t,)):
                        np.copyto(dst[0, :, s : s + n], _np(a)[0, :, :n])
        return True

    ok = each(move, len(items))
    bad = next((i for i, good in enumerate(ok) if not good), None)
    return dests, bad


# -------------------------------------------------------------------- CUDA


def _fill_device(items, spans, spec, length):
    rt = cuda.runtime()
    stored = [i for i, it in enumerate(items) if isinstance(it, Stored)]
    sizes: list[int] = []  # device buffers of at most _DEVICE_BUF bytes (mlx shapes are 32-bit)
    where: dict[int, tuple[int, int]] = {}  # block -> (buffer, offset)
    for i in stored:
        size = -(-len(items[i].payload) // 64) * 64
        if not sizes or sizes[-1] + size > _DEVICE_BUF:
            sizes.append(0)
        where[i] = (len(sizes) - 1, sizes[-1])
        sizes[-1] += size
    ok: dict[int, bool] = {}
    views: list[dict[str, mx.array]] = []
    if stored:
        devs = [mx.zeros((n,), mx.uint8) for n in sizes]  # written on the GPU: their pages live there
        mx.eval(devs)
        mx.synchronize()
        bases = [cuda.address(d) for d in devs]

        def move(j: int) -> bool:
            item = items[stored[j]]
            if not item.intact():
                return False
            b, off = where[stored[j]]
            cuda.upload(rt, bases[b] + off, item.payload)
            return True

        ok = dict(zip(stored, each(move, len(stored))))
        views = [{name: d.view(dt) for name, dt in _DTYPE.items()} for d in devs]
    bad = next((i for i in stored if not ok[i]), None)
    end = len(items) if bad is None else bad
    # runs of consecutive stored blocks of one byte layout, each cut as a strided matrix
    pieces: list[list[list[list[mx.array]]]] = [[[[] for _ in t[2]] for t in layer] for layer in spec]
    i = 0
    while i < end:
        item = items[i]
        if not isinstance(item, Stored):
            n = spans[i][1]
            for lp, layer in zip(pieces, item.layers):
                for tp, t in zip(lp, (layer.keys, layer.values)):
                    for p, a in zip(tp, t.arrays() if isinstance(t, Quantized) else (t,)):
                        p.append(a[..., :n, :])
            i += 1
            continue
        j = i + 1
        size = len(item.payload)
        while (j < end and isinstance(items[j], Stored) and len(items[j].payload) == size and size % 64 == 0
               and items[j].header.layers == item.header.layers and where[j][0] == where[i][0]
               and where[j][1] - where[j - 1][1] == size):
            j += 1
        m = j - i
        rows = sum(spans[k][1] for k in range(i, j))
        stride = -(-size // 64) * 64
        for lp, la in zip(pieces, _stored_arrays(item)):
            for tp, ta in zip(lp, la):
                for p, (name, shape, off, nb) in zip(tp, ta):
                    isz = np_dtype(name).itemsize
                    b, o = where[i]
                    flat = views[b][name][o // isz : (o + m * stride) // isz]
                    x = flat.reshape(m, stride // isz)[:, off // isz : (off + nb) // isz]
                    _, h, r, w = shape
                    x = x.reshape(m, h, r, w).transpose(1, 0, 2, 3).reshape(1, h, m * r, w)
                    p.append(x[..., :rows, :])
        i = j
    out = [[[p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for p in tp] for tp in lp] for lp in pieces]
    mx.eval([a for lp in out for tp in lp for a in tp])
    return out, bad
