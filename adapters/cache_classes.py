"""mlx-lm's cache classes as the store sees them: one ``CacheClass`` each.

mlx-lm's ``_BaseCache`` gives every cache class ``state`` (its arrays),
``meta_state`` (its parameters) and ``from_state`` (a cache rebuilt from
both). The store needs the same in its own terms, so each class has an object
(``of(cache)``) with ``read`` (its store layer, rows trimmed to what it holds:
its ``state``), ``describe`` (the parameters that are part of what the model
is: its ``meta_state``, for the layout and fingerprint) and ``build`` (a fresh
cache like the model's template holding a fetched layer: its ``from_state``).

How each class maps (one store layer per leaf cache, in order):

* ``KVCache``            -> ``KVLayer(keys, values, start=0, window=None)``,
  rows trimmed to ``offset`` (the engine over-allocates in steps of 256).
* ``QuantizedKVCache``   -> the same, but keys/values are ``Quantized`` triples
  (packed data, scales, biases) carrying the cache's bits and group size.
* ``RotatingKVCache``    -> its ring buffer put in temporal order.
  ``keep == 0`` (every model-made sliding-window cache): ``start = offset -
  rows held``, ``window = max_size``; restoring at ``L`` needs exactly rows
  ``[L - max_size, L)``, which is what the store serves for that window.
  ``keep > 0`` (only ``make_prompt_cache(model, max_kv_size=...)``, which keeps
  4 "sink" tokens): a restore needs tokens ``[0, keep)`` *and* the recent tail,
  which a single ``window`` cannot express, so the layer is stored as a full
  attention layer (``window=None``): all rows ``[0, offset)`` when the buffer
  still holds them; once rows were evicted, only the contiguous tail after the
  sink (``start > keep``), which the store can combine only with earlier puts
  of the same prefix. A restore then rebuilds the buffer that a one-shot
  prefill of ``L`` tokens leaves (all ``L`` rows, ``_idx = L``), which mlx-lm
  trims on its next update.
* ``ChunkedKVCache``     -> rows ``[start_position, offset)``,
  ``window = chunk_size`` (a query only sees its own chunk, which lies within
  the last ``chunk_size`` tokens).
* ``ArraysCache``        -> ``StateLayer(list(cache))`` (conv / SSM state,
  valid only at ``offset``).
* ``CacheList``          -> its sub-caches flattened into consecutive entries;
  the layout records the nesting and ``build`` rebuilds it from the model's
  own template.
* ``BatchKVCache`` / ``BatchRotatingKVCache`` hold several sequences with left
  padding; the store keys one token sequence, so the engine must
  ``extract(i)`` a row first: every method refuses them.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as C

from kvstore.blocks.codec import convert, densify
from kvstore.blocks.layers import KVLayer, Layer, Quantized, StateLayer, Tensor, own, take_rows

# mlx-lm's allocation step for KVCache / QuantizedKVCache buffers.
_STEP = 256

Quant = Optional[tuple[int, int]]  # (bits, group size) a rebuilt full-attention cache is quantized with


# ---------------------------------------------------------------------------
# small array helpers
# ---------------------------------------------------------------------------


def _rows(t: Tensor, n: int) -> Tensor:
    """First ``n`` rows of the token axis as new, compact arrays: a plain slice
    would share (and keep alive) the engine's over-allocated buffer."""
    return own(take_rows(t, 0, n))


def alias(t: Tensor) -> Tensor:
    """``t`` as new array objects on its data: no graph node, no copy (the
    engine's own slice assignments rebind its objects, never these)."""
    return t.with_arrays(*(a[...] for a in t.arrays())) if isinstance(t, Quantized) else t[...]


def kv(k: Tensor, v: Tensor, n: int, copy: bool, start: int = 0, window: Optional[int] = None) -> KVLayer:
    """Rows ``[0, n)`` of ``k`` and ``v``: compact copies, or (``copy=False``)
    the engine's buffers themselves with ``rows=n``: no slice to build and
    evaluate on the engine's thread."""
    if copy:
        return KVLayer(_rows(k, n), _rows(v, n), start, window)
    return KVLayer(alias(k), alias(v), start, window, rows=n)


def _batch(t: Tensor) -> int:
    return (t.data if isinstance(t, Quantized) else t).shape[0]


def _check_batch(t: Tensor, what: str) -> None:
    if _batch(t) != 1:
        raise ValueError(f"{what}: batch size {_batch(t)}; the store keys a single token sequence, "
                         "so caches must have batch size 1")


def _quantize(t: Tensor, bits: int, group_size: int) -> Quantized:
    """``t`` as a ``Quantized`` with exactly the engine's settings
    (``codec.convert``: same settings pass through, others are requantized from
    the dequantized values, dense goes through the same ``mx.quantize`` call as
    mlx-lm's ``to_quantized``, so the result is bit-identical to the engine
    quantizing its own cache). Rows stored rotated (keys or values) go through
    their dequantized values: the engine attends to plain rows."""
    if isinstance(t, Quantized) and t.rotation is not None:
        t = t.dequantize()
    q = convert(t, bits, group_size)
    if not isinstance(q, Quantized) or q.group_size != group_size:
        raise ValueError(f"a head dim of {t.shape[-1]} cannot be quantized in groups of {group_size}")
    return q


def _engine_alloc(x: mx.array, length: int) -> mx.array:
    """Rows ``[0, length)`` in a buffer sized the way ``KVCache`` sizes it after
    one prefill of ``length`` tokens (a multiple of 256, spare rows zero), so
    the rebuilt cache's ``state``/``nbytes`` match the engine's own and the
    first decode steps write in place instead of reallocating."""
    cap = -(-length // _STEP) * _STEP
    if cap == length:
        return own(x)
    spare = mx.zeros((*x.shape[:-2], cap - length, x.shape[-1]), dtype=x.dtype)
    return mx.concatenate([x, spare], axis=-2)  # each byte written once (zeros, then the rows, wrote them twice)


def _span(l: KVLayer, lo: int, hi: int, where: str) -> tuple[Tensor, Tensor]:
    """Rows for tokens ``[lo, hi)`` of a fetched layer (validated)."""
    if l.start > lo or l.stop < hi:
        raise ValueError(f"{where}: need tokens [{lo}, {hi}) but the entry covers [{l.start}, {l.stop})")
    _check_batch(l.keys, where)
    a, b = lo - l.start, hi - l.start
    return take_rows(l.keys, a, b), take_rows(l.values, a, b)


class Cursor:
    """Walks the flat layer list while the template tree is rebuilt."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = list(layers)
        self.i = 0

    def next(self, kind: type, what: str) -> Any:
        if self.i >= len(self.layers):
            raise ValueError(f"got {len(self.layers)} layers but the model's cache layout needs more")
        l = self.layers[self.i]
        if not isinstance(l, kind):
            raise ValueError(f"entry {self.i} is a {type(l).__name__} but {what} needs a {kind.__name__}")
        self.i += 1
        return l


# ---------------------------------------------------------------------------
# one object per cache class
# ---------------------------------------------------------------------------


class CacheClass:
    """How the store reads, describes and rebuilds one mlx-lm cache class."""

    layer = KVLayer  # the store layer one leaf of this class is

    def describe(self, c: Any) -> str:
        raise NotImplementedError

    def offset(self, c: Any) -> Optional[int]:
        """Tokens the cache has processed (``None``: state without a position counter)."""
        return int(c.offset)

    def leaves(self, c: Any) -> Iterator[Any]:
        yield c

    def read(self, c: Any, where: str, length: Optional[int], copy: bool, out: list[Layer]) -> None:
        """Append the cache's layer, its first ``length`` tokens (``None``: all
        it holds): compact copies, or with ``copy=False`` new array objects on
        the engine's buffers (see ``cache_to_layers``)."""
        raise NotImplementedError

    def build(self, t: Any, cur: Cursor, length: int, quant: Quant, where: str) -> Any:
        """A fresh cache like the template ``t`` holding the next layer(s) of
        ``cur`` at ``length`` tokens, as the engine holds it after prefilling
        them itself."""
        return self.restore(t, cur.next(self.layer, f"{where} ({type(t).__name__})"), length, quant, where)

    def restore(self, t: Any, l: Any, length: int, quant: Quant, where: str) -> Any:
        raise NotImplementedError

    def arrays(self, c: Any) -> list[mx.array]:
        out: list[mx.array] = []
        for t in (c.keys, c.values):
            out.extend(t if isinstance(t, tuple) else [t])
        return out


class _Attention(CacheClass):
    """Key/value rows; ``trimmable``: cut back to any shorter prefix."""

    trimmable = False

    def read(self, c: Any, where: str, length: Optional[int], copy: bool, out: list[Layer]) -> None:
        if c.keys is None:
            raise ValueError(f"{where}: {type(c).__name__} holds no tokens")
        n = c.offset if length is None else length
        if n > c.offset:
            raise ValueError(f"{where}: asked for {n} tokens but the cache holds {c.offset}")
        if n < c.offset and not self.trimmable:
            raise ValueError(f"{where}: a {type(c).__name__} cannot be cut back from {c.offset} to {n} tokens")
        out.append(self.rows(c, n, copy, where))

    def rows(self, c: Any, n: int, copy: bool, where: str) -> KVLayer:
        _check_batch(c.keys, where)
        return kv(c.keys, c.values, n, copy)


class _KV(_Attention):
    """``KVCache``; and the class a full-attention slot is rebuilt as: a
    ``QuantizedKVCache`` when the engine quantizes (``quant``)."""

    trimmable = True

    def describe(self, c: Any) -> str:
        # KVCache, QuantizedKVCache and ConcatenateKVCache all mean "full attention, every row needed": whether
        # the engine quantizes its KV cache is a serving option, not part of what the model is, and the
        # Quantized tensors carry their own settings
        return "KV"

    def restore(self, t: Any, l: KVLayer, length: int, quant: Quant, where: str) -> Any:
        k, v = _span(l, 0, length, where)
        if quant is not None:
            bits, group = quant
            c = C.QuantizedKVCache(group_size=group, bits=bits)
            qk, qv = _quantize(k, bits, group), _quantize(v, bits, group)
            c.keys = tuple(_engine_alloc(a, length) for a in qk.arrays())
            c.values = tuple(_engine_alloc(a, length) for a in qv.arrays())
        else:
            c = C.KVCache()
            c.keys = _engine_alloc(densify(k), length)
            c.values = _engine_alloc(densify(v), length)
        c.offset = length
        return c


class _QuantizedKV(_KV):
    def rows(self, c: Any, n: int, copy: bool, where: str) -> KVLayer:
        _check_batch(c.keys[0], where)
        return kv(Quantized(*c.keys, c.bits, c.group_size), Quantized(*c.values, c.bits, c.group_size), n, copy)

    def restore(self, t: Any, l: KVLayer, length: int, quant: Quant, where: str) -> Any:
        return super().restore(t, l, length, (t.bits, t.group_size), where)  # a model whose own template is quantized


class _ConcatenateKV(_KV):
    def restore(self, t: Any, l: KVLayer, length: int, quant: Quant, where: str) -> Any:
        k, v = _span(l, 0, length, where)
        c = C.ConcatenateKVCache()
        c.keys, c.values = own(densify(k)), own(densify(v))
        c.offset = length
        return c


class _RotatingKV(_Attention):
    def describe(self, c: Any) -> str:
        return f"Rotating(max_size={c.max_size},keep={c.keep})"

    def rows(self, c: Any, n: int, copy: bool, where: str) -> KVLayer:
        _check_batch(c.keys, where)
        # mlx-lm's own reordering: sink rows [0, keep), then the ring from the
        # write position on, then the ring before it; slices off unused rows.
        fresh = own if copy else alias
        k = c._temporal_order(c.keys)
        v = c._temporal_order(c.values)
        held = k.shape[2]
        if c.keep == 0:
            return KVLayer(fresh(k), fresh(v), start=c.offset - held, window=c.max_size)
        if held >= c.offset:
            # Nothing evicted yet: rows are exactly tokens [0, offset).
            return kv(k, v, n, copy)
        # Rows [keep, held) are the contiguous tail ending at offset; the sink
        # rows [0, keep) can't share an entry with them (gap in between).
        tail = held - c.keep
        return KVLayer(fresh(k[..., c.keep :, :]), fresh(v[..., c.keep :, :]), start=c.offset - tail, window=None)

    def restore(self, t: Any, l: KVLayer, length: int, quant: Quant, where: str) -> Any:
        # mlx-lm has no quantized rotating cache (its to_quantized raises), so
        # quantized entries are dequantized.
        if t.keep == 0:
            # The next token sees the last max_size - 1 tokens; holding
            # max_size rows (a full ring, _idx = max_size) is the state both the
            # in-place and the concat update path continue from exactly as
            # after a one-shot prefill.
            lo = max(0, length - t.max_size)
        else:
            lo = 0  # sink rows + tail are needed; see the module docstring
        k, v = _span(l, lo, length, where)
        c = C.RotatingKVCache(max_size=t.max_size, keep=t.keep)
        c.keys, c.values = own(densify(k)), own(densify(v))
        c.offset = length
        c._idx = length - lo
        return c


class _ChunkedKV(_Attention):
    def describe(self, c: Any) -> str:
        return f"Chunked(chunk_size={c.chunk_size})"

    def rows(self, c: Any, n: int, copy: bool, where: str) -> KVLayer:
        _check_batch(c.keys, where)
        return kv(c.keys, c.values, c.offset - c.start_position, copy, c.start_position, c.chunk_size)

    def restore(self, t: Any, l: KVLayer, length: int, quant: Quant, where: str) -> Any:
        # All chunked layers get the same start_position (llama4 builds the
        # chunk mask from cache[0].start_position), and maybe_trim_front() is a
        # no-op on it, as after the engine's own trim.
        lo = max(0, length - t.chunk_size)
        k, v = _span(l, lo, length, where)
        c = C.ChunkedKVCache(t.chunk_size)
        c.keys, c.values = own(densify(k)), own(densify(v))
        c.offset = length
        c.start_position = lo
        return c


class _Arrays(CacheClass):
    """Recurrent (conv / SSM) state: valid only at the offset it was taken."""

    layer = StateLayer

    def describe(self, c: Any) -> str:
        return f"Arrays({len(c.cache)})"

    def offset(self, c: Any) -> Optional[int]:
        return None

    def read(self, c: Any, where: str, length: Optional[int], copy: bool, out: list[Layer]) -> None:
        if c.left_padding is not None or c.lengths is not None:
            raise ValueError(f"{where}: ArraysCache has left_padding/lengths set (a batched or mid-prefill "
                             "state); only a finalized single sequence can be stored")
        for a in c.cache:
            if a is not None:
                _check_batch(a, where)
        # a new array object either way: the engine may assign into its own
        out.append(StateLayer([None if a is None else (own(a) if copy else alias(a)) for a in c.cache]))

    def restore(self, t: Any, l: StateLayer, length: int, quant: Quant, where: str) -> Any:
        if len(l.arrays) != len(t.cache):
            raise ValueError(f"{where}: ArraysCache has {len(t.cache)} slots, entry has {len(l.arrays)}")
        c = C.ArraysCache(len(t.cache))
        for a in l.arrays:
            if a is not None:
                _check_batch(a, where)
        c.cache = [None if a is None else own(a) for a in l.arrays]
        return c

    def arrays(self, c: Any) -> list[mx.array]:
        return [a for a in c.cache if a is not None]


class _List(CacheClass):
    """``CacheList``: its sub-caches, flattened in order."""

    def describe(self, c: Any) -> str:
        return "CacheList(" + ",".join(describe(s) for s in c.caches) + ")"

    def offset(self, c: Any) -> Optional[int]:
        return None  # its leaves count

    def leaves(self, c: Any) -> Iterator[Any]:
        return leaves(c.caches)

    def read(self, c: Any, where: str, length: Optional[int], copy: bool, out: list[Layer]) -> None:
        for j, s in enumerate(c.caches):
            of(s, f"{where}.{j}").read(s, f"{where}.{j}", length, copy, out)

    def build(self, t: Any, cur: Cursor, length: int, quant: Quant, where: str) -> Any:
        # mlx-lm only quantizes top-level caches (CacheList has no to_quantized).
        return C.CacheList(*(of(s, f"{where}.{j}").build(s, cur, length, None, f"{where}.{j}")
                             for j, s in enumerate(t.caches)))

    def arrays(self, c: Any) -> list[mx.array]:
        return [a for s in c.caches for a in of(s).arrays(s)]


class _Batched(CacheClass):
    """Several sequences with left padding: refused (``extract(i)`` one first)."""

    def describe(self, c: Any) -> str:
        raise ValueError(f"{type(c).__name__} holds a batch; extract(i) one sequence first")

    def offset(self, c: Any) -> Optional[int]:
        return None

    def read(self, c: Any, where: str, length: Optional[int], copy: bool, out: list[Layer]) -> None:
        raise ValueError(f"{where}: {type(c).__name__} holds a batch; extract(i) one sequence first")

    def build(self, t: Any, cur: Cursor, length: int, quant: Quant, where: str) -> Any:
        raise ValueError(f"{where}: the model's template is a batched {type(t).__name__}")


_CLASSES: dict[type, CacheClass] = {
    C.KVCache: _KV(),
    C.QuantizedKVCache: _QuantizedKV(),
    C.ConcatenateKVCache: _ConcatenateKV(),
    C.RotatingKVCache: _RotatingKV(),
    C.ChunkedKVCache: _ChunkedKV(),
    C.ArraysCache: _Arrays(),
    C.CacheList: _List(),
    **{getattr(C, name): _Batched() for name in ("BatchKVCache", "BatchRotatingKVCache") if hasattr(C, name)},
}


def find(c: Any) -> Optional[CacheClass]:
    """The ``CacheClass`` of ``c``'s class or its nearest registered base; ``None`` for none."""
    for cls in type(c).__mro__:
        got = _CLASSES.get(cls)
        if got is not None:
            return got
    return None


def of(c: Any, where: str = "") -> CacheClass:
    """``find(c)``; ``TypeError`` for a class the store does not know."""
    got = find(c)
    if got is None:
        raise TypeError(f"{where}: " * bool(where) + f"unsupported mlx-lm cache class {type(c).__name__}")
    return got


def leaves(prompt_cache: Iterable[Any]) -> Iterator[Any]:
    """The leaf caches, ``CacheList`` children inline."""
    for c in prompt_cache:
        got = find(c)
        if got is None:
            yield c
        else:
            yield from got.leaves(c)


def describe(c: Any) -> str:
    """One cache object as a short, stable string (class family + parameters)."""
    return of(c).describe(c)
