"""mlx-lm adapter, conversion half: mlx-lm prompt caches <-> ``kvstore`` layers.

The store speaks :mod:`kvstore.blocks.layers` (one ``KVLayer`` / ``StateLayer`` per
cache slot); mlx-lm speaks its cache classes from ``mlx_lm.models.cache``. This
module is the only place that knows both.

How each mlx-lm cache class maps (one entry per leaf cache, in order):

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
  :func:`cache_layout` records the nesting and :func:`layers_to_cache` rebuilds
  it from the model's own template.

Every array handed out is a fresh, evaluated ``mx.array`` object: mlx-lm
updates its buffers with in-place slice assignment, which rewrites the Python
array object it is applied to (any alias sees the new contents), and the store
works on a background thread where a lazy graph built on this thread cannot be
evaluated (mlx streams are thread-local). The same holds in the other
direction: rebuilt caches never alias the arrays the store handed over.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models import cache as C

from kvstore.blocks.codec import convert, densify, layer_arrays
from kvstore.blocks.layers import WARM_LAYERS, KVLayer, Layer, Quantized, StateLayer, Tensor, own, take_rows

from .file_digests import file_digests

__all__ = [
    "cache_to_layers",
    "layers_to_cache",
    "cache_layout",
    "layout_signature",
    "cache_offset",
    "layer_count",
    "caches_to_layers",
    "layers_to_caches",
    "snapshot",
    "model_fingerprint",
    "adapter_fingerprint",
    "loaded_model_fingerprint",
    "ADAPTER_FILES",
]

# mlx-lm's allocation step for KVCache / QuantizedKVCache buffers.
_STEP = 256

# Batched caches hold several sequences with left padding; the store keys one
# token sequence, so the engine must ``extract(i)`` a row first.
_BATCHED = tuple(
    getattr(C, name)
    for name in ("BatchKVCache", "BatchRotatingKVCache")
    if hasattr(C, name)
)


# ---------------------------------------------------------------------------
# small array helpers
# ---------------------------------------------------------------------------


def _rows(t: Tensor, n: int) -> Tensor:
    """First ``n`` rows of the token axis as new, compact arrays: a plain slice
    would share (and keep alive) the engine's over-allocated buffer."""
    return own(take_rows(t, 0, n))


def _alias(t: Tensor) -> Tensor:
    """``t`` as new array objects on its data: no graph node, no copy (the
    engine's own slice assignments rebind its objects, never these)."""
    return t.with_arrays(*(a[...] for a in t.arrays())) if isinstance(t, Quantized) else t[...]


def _kv(k: Tensor, v: Tensor, n: int, copy: bool, start: int = 0, window: Optional[int] = None) -> KVLayer:
    """Rows ``[0, n)`` of ``k`` and ``v``: compact copies, or (``copy=False``)
    the engine's buffers themselves with ``rows=n``: no slice to build and
    evaluate on the engine's thread."""
    if copy:
        return KVLayer(_rows(k, n), _rows(v, n), start, window)
    return KVLayer(_alias(k), _alias(v), start, window, rows=n)


def _batch(t: Tensor) -> int:
    return (t.data if isinstance(t, Quantized) else t).shape[0]


def _check_batch(t: Tensor, what: str) -> None:
    if _batch(t) != 1:
        raise ValueError(
            f"{what}: batch size {_batch(t)}; the store keys a single token "
            "sequence, so caches must have batch size 1"
        )


# ---------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------


def _describe(c: Any) -> str:
    """One cache object as a short, stable string (class family + parameters).

    ``KVCache``, ``QuantizedKVCache`` and ``ConcatenateKVCache`` all mean "full
    attention, every row needed", so they share ``KV``: whether the engine
    quantizes its KV cache is a serving option, not part of what the model is,
    and the ``Quantized`` tensors carry their own settings.
    """
    if isinstance(c, _BATCHED):
        raise ValueError(
            f"{type(c).__name__} holds a batch; extract(i) one sequence first"
        )
    if isinstance(c, C.CacheList):
        return "CacheList(" + ",".join(_describe(s) for s in c.caches) + ")"
    if isinstance(c, (C.KVCache, C.QuantizedKVCache, C.ConcatenateKVCache)):
        return "KV"
    if isinstance(c, C.RotatingKVCache):
        return f"Rotating(max_size={c.max_size},keep={c.keep})"
    if isinstance(c, C.ChunkedKVCache):
        return f"Chunked(chunk_size={c.chunk_size})"
    if isinstance(c, C.ArraysCache):
        return f"Arrays({len(c.cache)})"
    raise TypeError(f"unsupported mlx-lm cache class {type(c).__name__}")


def cache_layout(prompt_cache_or_model: Union[Sequence[Any], nn.Module]) -> list[str]:
    """One descriptor per top-level cache slot, nesting spelled out.

    Accepts a prompt cache (the list ``make_prompt_cache`` returns) or a model
    (whose fresh ``make_prompt_cache(model)`` is described). Goes into the model
    fingerprint so one store never mixes entries of different layouts, e.g.
    ``['Rotating(max_size=512,keep=0)', 'KV', 'CacheList(Arrays(2),KV)']``.
    """
    if isinstance(prompt_cache_or_model, nn.Module):
        prompt_cache_or_model = C.make_prompt_cache(prompt_cache_or_model)
    return [_describe(c) for c in prompt_cache_or_model]


def layout_signature(prompt_cache_or_model: Union[Sequence[Any], nn.Module]) -> str:
    """:func:`cache_layout` as one string (``;``-joined)."""
    return ";".join(cache_layout(prompt_cache_or_model))


# ---------------------------------------------------------------------------
# engine cache -> layers
# ---------------------------------------------------------------------------


def _kv_offset(c: Any) -> Optional[int]:
    """Tokens a leaf KV-type cache has processed (``None`` for state caches)."""
    if isinstance(
        c, (C.KVCache, C.QuantizedKVCache, C.RotatingKVCache, C.ChunkedKVCache,
            C.ConcatenateKVCache)
    ):
        return int(c.offset)
    return None


def _leaves(prompt_cache: Iterable[Any]) -> Iterator[Any]:
    for c in prompt_cache:
        if isinstance(c, C.CacheList):
            yield from _leaves(c.caches)
        else:
            yield c


def cache_offset(prompt_cache: Sequence[Any]) -> int:
    """Number of tokens the prompt cache covers (the KV caches' common offset).

    Raises ``ValueError`` if the attention caches disagree (a half-updated
    cache must never be stored) or if there is no attention cache at all (a
    pure recurrent model has no position counter: the caller must know).
    """
    offsets = {o for o in map(_kv_offset, _leaves(prompt_cache)) if o is not None}
    if len(offsets) > 1:
        raise ValueError(f"cache layers disagree on the token count: {sorted(offsets)}")
    if not offsets:
        raise ValueError("no attention cache to read the token count from")
    return offsets.pop()


def _kv_entry(c: Any, where: str, length: Optional[int], copy: bool) -> KVLayer:
    if c.keys is None:
        raise ValueError(f"{where}: {type(c).__name__} holds no tokens")
    n = c.offset if length is None else length
    if n > c.offset:
        raise ValueError(f"{where}: asked for {n} tokens but the cache holds {c.offset}")
    trimmable = isinstance(c, (C.KVCache, C.QuantizedKVCache, C.ConcatenateKVCache))
    if n < c.offset and not trimmable:
        raise ValueError(f"{where}: a {type(c).__name__} cannot be cut back from {c.offset} to {n} tokens")

    if isinstance(c, C.QuantizedKVCache):
        _check_batch(c.keys[0], where)
        return _kv(Quantized(*c.keys, c.bits, c.group_size), Quantized(*c.values, c.bits, c.group_size), n, copy)

    _check_batch(c.keys, where)

    if trimmable:
        return _kv(c.keys, c.values, n, copy)

    if isinstance(c, C.RotatingKVCache):
        # mlx-lm's own reordering: sink rows [0, keep), then the ring from the
        # write position on, then the ring before it; slices off unused rows.
        fresh = own if copy else _alias
        k = c._temporal_order(c.keys)
        v = c._temporal_order(c.values)
        held = k.shape[2]
        if c.keep == 0:
            return KVLayer(fresh(k), fresh(v), start=c.offset - held, window=c.max_size)
        if held >= c.offset:
            # Nothing evicted yet: rows are exactly tokens [0, offset).
            return _kv(k, v, n, copy)
        # Rows [keep, held) are the contiguous tail ending at offset; the sink
        # rows [0, keep) can't share an entry with them (gap in between).
        tail = held - c.keep
        return KVLayer(
            fresh(k[..., c.keep :, :]),
            fresh(v[..., c.keep :, :]),
            start=c.offset - tail,
            window=None,
        )

    if isinstance(c, C.ChunkedKVCache):
        return _kv(c.keys, c.values, c.offset - c.start_position, copy, c.start_position, c.chunk_size)

    raise TypeError(f"{where}: unsupported mlx-lm cache class {type(c).__name__}")


def _flatten(c: Any, where: str, out: list[Layer], length: Optional[int], copy: bool) -> None:
    if type(c) is C.KVCache and not copy and c.keys is not None and c.keys.shape[0] == 1 \
            and (length is None or length <= c.offset):
        # the common leaf as _kv_entry takes it, without its general checks (a put's hot loop)
        out.append(_kv(c.keys, c.values, c.offset if length is None else length, copy=False))
        return
    if isinstance(c, _BATCHED):
        raise ValueError(
            f"{where}: {type(c).__name__} holds a batch; extract(i) one sequence first"
        )
    if isinstance(c, C.CacheList):
        for j, s in enumerate(c.caches):
            _flatten(s, f"{where}.{j}", out, length, copy)
    elif isinstance(c, C.ArraysCache):
        if c.left_padding is not None or c.lengths is not None:
            raise ValueError(
                f"{where}: ArraysCache has left_padding/lengths set (a batched or "
                "mid-prefill state); only a finalized single sequence can be stored"
            )
        for a in c.cache:
            if a is not None:
                _check_batch(a, where)
        # a new array object either way: the engine may assign into its own
        out.append(StateLayer([None if a is None else (own(a) if copy else _alias(a)) for a in c.cache]))
    else:
        out.append(_kv_entry(c, where, length, copy))


def cache_to_layers(prompt_cache: Sequence[Any], *, length: Optional[int] = None,
                    copy: bool = True) -> list[Layer]:
    """Flatten an mlx-lm prompt cache (batch size 1) into store layers.

    One entry per leaf cache, ``CacheList`` children inline. Buffers are trimmed
    to what the cache really holds -- or to its first ``length`` tokens, which
    only full-attention caches can be cut back to (``ValueError`` otherwise,
    and for recurrent state, valid only where it was taken). The attention
    caches must agree on the token count (see :func:`cache_offset`).

    ``copy=True`` returns compact, evaluated copies, evaluated here, on the
    engine's thread, because the store consumes them on its own thread.
    ``copy=False`` returns new array objects on the engine's buffers, with
    ``rows`` where a buffer holds more (the engine's own slice assignments
    rebind its objects, never these, and mlx never writes in place into data
    another array still shares), for a caller that evaluates them itself.
    """
    out: list[Layer] = []
    for i, c in enumerate(prompt_cache):
        _flatten(c, f"layer {i}", out, length, copy)
    offsets = {l.stop for l in out if isinstance(l, KVLayer)}
    if len(offsets) > 1:
        raise ValueError(f"cache layers disagree on the token count: {sorted(offsets)}")
    if length is not None and any(isinstance(l, StateLayer) for l in out) and length != cache_offset(prompt_cache):
        raise ValueError(f"recurrent state is valid only at {cache_offset(prompt_cache)} tokens, not {length}")
    if copy:
        mx.eval([a for l in out for a in layer_arrays(l)])
    return out


def _alias_all(v: Any, arrays: list[mx.array], fresh: Callable[[mx.array], mx.array]) -> Any:
    if isinstance(v, mx.array):
        a = fresh(v)
        arrays.append(a)
        return a
    if isinstance(v, (list, tuple)) and any(isinstance(x, mx.array) for x in v):
        return type(v)(_alias_all(x, arrays, fresh) for x in v)
    return v


def _snapshot(c: Any, arrays: list[mx.array]) -> Any:
    s = copy.copy(c)
    # KV: a new node on the same (possibly still computing) data, no copy. Not mx.array(v), a copy op (the
    # whole cache copied on the engine's stream), nor v[...], which is the engine's own array record, whose
    # evaluation state the inserts thread would then update beside the engine. A recurrent state is small and
    # copied: mlx-lm's batch extract makes it a view that would keep the whole batch's state alive.
    fresh = mx.array if isinstance(c, C.ArraysCache) else mx.stop_gradient
    for name, v in vars(c).items():
        if name == "caches" and isinstance(c, C.CacheList):
            v = type(v)(_snapshot(x, arrays) for x in v)
        setattr(s, name, _alias_all(v, arrays, fresh))
    return s


def snapshot(prompt_cache: Sequence[Any]) -> tuple[list[Any], list[mx.array]]:
    """The prompt cache as it is now, for another thread, in microseconds.

    New cache objects of the same classes and settings whose arrays are new
    arrays on the engine's data: no KV is copied, nothing is waited for (a
    recurrent state's few arrays are copied). The engine's later updates never reach them (they rebind
    or slice-assign its own objects, and mlx never writes in place into data
    another array still shares). Returns the copies and their arrays: call
    ``mx.async_eval(arrays)`` on this thread (arrays an engine left unevaluated
    can only be evaluated from the thread that built them); another thread
    may then ``mx.eval`` them, which waits, and take the layers with
    ``cache_to_layers``.
    """
    arrays: list[mx.array] = []
    return [_snapshot(c, arrays) for c in prompt_cache], arrays


def layer_count(model: nn.Module) -> int:
    """How many store layers the model's prompt cache flattens to."""
    return sum(1 for _ in _leaves(C.make_prompt_cache(model)))


def caches_to_layers(parts: Sequence[Sequence[Any]], *, copy: bool = True) -> tuple[int, list[Layer]]:
    """The layers of several models' prompt caches as one list, and the
    tokens they cover: a main model's and its draft's (speculative decoding),
    cut to the tokens every part holds (a draft can be one token behind)."""
    n = min(cache_offset(p) for p in parts)
    return n, ([l for p in parts for l in cache_to_layers(p, length=n, copy=copy)] if n else [])


# ---------------------------------------------------------------------------
# layers -> engine cache
# ---------------------------------------------------------------------------


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


class _Cursor:
    """Walks the flat layer list while the template tree is rebuilt."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = list(layers)
        self.i = 0

    def next(self, kind: type, what: str) -> Any:
        if self.i >= len(self.layers):
            raise ValueError(
                f"got {len(self.layers)} layers but the model's cache layout needs more"
            )
        l = self.layers[self.i]
        if not isinstance(l, kind):
            raise ValueError(
                f"entry {self.i} is a {type(l).__name__} but {what} needs a {kind.__name__}"
            )
        self.i += 1
        return l


def _span(l: KVLayer, lo: int, hi: int, where: str) -> tuple[Tensor, Tensor]:
    """Rows for tokens ``[lo, hi)`` of a fetched layer (validated)."""
    if l.start > lo or l.stop < hi:
        raise ValueError(
            f"{where}: need tokens [{lo}, {hi}) but the entry covers "
            f"[{l.start}, {l.stop})"
        )
    _check_batch(l.keys, where)
    a, b = lo - l.start, hi - l.start
    return take_rows(l.keys, a, b), take_rows(l.values, a, b)


def _rebuild(
    t: Any,
    cur: _Cursor,
    length: int,
    quant: Optional[tuple[int, int]],
    where: str,
) -> Any:
    name = type(t).__name__
    if isinstance(t, _BATCHED):
        raise ValueError(f"{where}: the model's template is a batched {name}")

    if isinstance(t, C.CacheList):
        # mlx-lm only quantizes top-level caches (CacheList has no to_quantized).
        return C.CacheList(
            *(_rebuild(s, cur, length, None, f"{where}.{j}") for j, s in enumerate(t.caches))
        )

    if isinstance(t, C.ArraysCache):
        l = cur.next(StateLayer, f"{where} ({name})")
        if len(l.arrays) != len(t.cache):
            raise ValueError(
                f"{where}: ArraysCache has {len(t.cache)} slots, entry has {len(l.arrays)}"
            )
        c = C.ArraysCache(len(t.cache))
        for a in l.arrays:
            if a is not None:
                _check_batch(a, where)
        c.cache = [None if a is None else own(a) for a in l.arrays]
        return c

    l = cur.next(KVLayer, f"{where} ({name})")

    if isinstance(t, C.QuantizedKVCache):  # a model whose own template is quantized
        quant = (t.bits, t.group_size)
    if isinstance(t, (C.KVCache, C.QuantizedKVCache)):
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

    if isinstance(t, C.RotatingKVCache):
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

    if isinstance(t, C.ChunkedKVCache):
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

    if isinstance(t, C.ConcatenateKVCache):
        k, v = _span(l, 0, length, where)
        c = C.ConcatenateKVCache()
        c.keys, c.values = own(densify(k)), own(densify(v))
        c.offset = length
        return c

    raise TypeError(f"{where}: unsupported mlx-lm cache class {name}")


def _cache_arrays(c: Any) -> list[mx.array]:
    if isinstance(c, C.CacheList):
        return [a for s in c.caches for a in _cache_arrays(s)]
    if isinstance(c, C.ArraysCache):
        return [a for a in c.cache if a is not None]
    out: list[mx.array] = []
    for t in (c.keys, c.values):
        out.extend(t if isinstance(t, tuple) else [t])
    return out


def layers_to_cache(
    layers: Sequence[Layer],
    model: nn.Module,
    *,
    length: int,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: Optional[int] = None,
) -> list[Any]:
    """Build a fresh mlx-lm prompt cache from entries fetched at ``length``.

    ``make_prompt_cache(model, max_kv_size)`` is the template, so classes and
    parameters (windows, keep, nesting) are the model's own; the result behaves
    like the cache the engine would hold after prefilling those ``length``
    tokens itself (offset, size, masks, trim, updates, batching merge).

    ``kv_bits`` mirrors mlx-lm's ``maybe_quantize_kv_cache``: when set and
    ``length >= quantized_kv_start``, every top-level ``KVCache`` slot becomes
    a ``QuantizedKVCache(kv_group_size, kv_bits)``, built straight from the
    fetched ``Quantized`` tensors when their settings match (requantized
    otherwise, quantized when dense). Without ``kv_bits`` quantized entries are
    dequantized. Rotating / chunked / nested caches are never quantized, as in
    mlx-lm.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    template = C.make_prompt_cache(model, max_kv_size=max_kv_size)
    quant = (kv_bits, kv_group_size) if kv_bits and length >= quantized_kv_start else None
    cur = _Cursor(layers)
    out = [_rebuild(t, cur, length, quant, f"layer {i}") for i, t in enumerate(template)]
    if cur.i != len(cur.layers):
        raise ValueError(
            f"got {len(cur.layers)} layers but the model's cache layout has {cur.i}"
        )
    mx.eval([a for c in out for a in _cache_arrays(c)])
    return out


def layers_to_caches(layers: Sequence[Layer], models: Sequence[nn.Module], *, length: int, **kwargs) -> list[Any]:
    """The inverse of :func:`caches_to_layers`: one prompt-cache list, each
    model's caches (``layers_to_cache(..., **kwargs)``) after the previous one's."""
    out: list[Any] = []
    i = 0
    for model in models:
        n = layer_count(model)
        out += layers_to_cache(layers[i : i + n], model, length=length, **kwargs)
        i += n
    if i != len(layers):
        raise ValueError(f"got {len(layers)} layers but the models' cache layouts have {i}")
    return out


# ---------------------------------------------------------------------------
# model fingerprint
# ---------------------------------------------------------------------------

_FP_TAG = b"kvstore-mlx-lm-fingerprint-v2"
# what transformers' AutoTokenizer reads that maps text to ids
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt")


def _field(h: "xxhash.xxh3_128", name: str, data: bytes) -> None:
    """Length-prefixed, named field: no two field sequences hash the same."""
    tag = name.encode()
    h.update(len(tag).to_bytes(4, "little") + tag + len(data).to_bytes(8, "little"))
    h.update(data)


def _canonical_json(path: Path) -> bytes:
    """A JSON file's content without its formatting and key order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def model_fingerprint(
    model_path: Union[str, os.PathLike],
    prompt_cache_or_model: Union[Sequence[Any], nn.Module, None] = None,
    extra: str = "",
) -> str:
    """What the model *is* (not what it is called), as an xxh3-128 hex digest.

    Hashes the canonical JSON of ``config.json``, the whole content of the
    tokenizer files present and of every ``*.safetensors`` file (each file's
    digest is remembered per file identity: see ``file_digests``), the cache
    layout of ``prompt_cache_or_model`` when given (pass it: the same weights
    under another cache layout, e.g. ``max_kv_size``, must not share entries),
    and ``extra`` (e.g. an adapter's fingerprint or a dtype override the caller
    applies). Only explicit bytes are hashed, so the value is the same in every process.
    """
    root = Path(model_path)
    h = xxhash.xxh3_128()
    h.update(_FP_TAG)
    _field(h, "config.json", _canonical_json(root / "config.json"))
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weight files in {root}")
    names = [n for n in _TOKENIZER_FILES if (root / n).is_file()]
    for name, digest in zip(names + ["weights:" + p.name for p in weights],
                            file_digests([root / n for n in names] + weights)):
        _field(h, name, digest)
    if prompt_cache_or_model is not None:
        _field(h, "layout", layout_signature(prompt_cache_or_model).encode())
    _field(h, "extra", extra.encode("utf-8"))
    return h.hexdigest()


def loaded_model_fingerprint(model: nn.Module, extra: str = "") -> str:
    """What a loaded model computes with: its config, every module's kind and
    scalar settings (a LoRA layer's scale, a norm's eps), every parameter's
    name, shape, dtype and all its bytes (an adapter's too), and its cache
    layout. Hashed in memory (docs/benchmarks.md, fingerprint cost)."""
    h = xxhash.xxh3_128(b"kvstore-loaded-model-v2")
    args = getattr(model, "args", None)
    h.update(json.dumps(getattr(args, "__dict__", {}) or {}, sort_keys=True, default=str).encode())
    for name, module in model.named_modules():
        settings = {k: v for k, v in vars(module).items()
                    if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}
        h.update(f"{name}:{type(module).__name__}:{sorted(settings.items())}".encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{p.shape}:{p.dtype}".encode())
        h.update(memoryview(p.view(mx.uint16) if p.dtype == mx.bfloat16 else p).cast("B"))
    h.update(layout_signature(model).encode())
    h.update(extra.encode())
    return h.hexdigest()


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")  # what mlx-lm's load_adapters reads


def adapter_fingerprint(adapter_path: Union[str, os.PathLike]) -> str:
    """What an mlx-lm adapter folder holds, by content: the canonical JSON of
    ``adapter_config.json`` (layers, rank, scale, kind) and every byte of
    ``adapters.safetensors``, never its path (an adapter retrained in place
    keeps its path)."""
    root = Path(adapter_path)
    h = xxhash.xxh3_128(b"kvstore-mlx-lm-adapter-v1")
    _field(h, ADAPTER_FILES[0], _canonical_json(root / ADAPTER_FILES[0]))
    _field(h, ADAPTER_FILES[1], file_digests([root / ADAPTER_FILES[1]])[0])
    return h.hexdigest()


def _warm() -> None:
    """The engine-side put path (``caches_to_layers``, ``snapshot``) once, at
    import, on a throwaway cache of one-row layers that is never evaluated:
    Python's first pass over code costs about twice its later ones, and it
    would otherwise land on the engine's first put (docs/benchmarks.md, put).
    Its ops go to the CPU's stream: importing never starts a GPU context (a
    process may fork after it)."""
    with mx.stream(mx.cpu):
        k = mx.zeros((1, 1, 1, 8), mx.float16)
        cache = [C.KVCache() for _ in range(WARM_LAYERS)]
        for c in cache:
            c.update_and_fetch(k, k)
        caches_to_layers([cache], copy=False)
        snapshot(cache)


_warm()
