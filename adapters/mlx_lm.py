"""mlx-lm adapter, conversion half: mlx-lm prompt caches <-> ``kvstore`` layers.

The store speaks :mod:`kvstore.blocks.layers` (one ``KVLayer`` / ``StateLayer`` per
cache slot); mlx-lm speaks its cache classes from ``mlx_lm.models.cache``.
This module and :mod:`.cache_classes` (how each cache class maps, and is
rebuilt) are the only places that know both. The model fingerprints
(:mod:`.fingerprints`) are importable from here too.

Every array handed out is a fresh, evaluated ``mx.array`` object: mlx-lm
updates its buffers with in-place slice assignment, which rewrites the Python
array object it is applied to (any alias sees the new contents), and the store
works on a background thread where a lazy graph built on this thread cannot be
evaluated (mlx streams are thread-local). The same holds in the other
direction: rebuilt caches never alias the arrays the store handed over.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as C

from kvstore.blocks.codec import layer_arrays
from kvstore.blocks.layers import WARM_LAYERS, KVLayer, Layer, StateLayer

from . import cache_classes as K
from .fingerprints import (ADAPTER_FILES, adapter_fingerprint, cache_layout, layout_signature, loaded_model_fingerprint,
                           model_fingerprint)

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


# ---------------------------------------------------------------------------
# engine cache -> layers
# ---------------------------------------------------------------------------


def cache_offset(prompt_cache: Sequence[Any]) -> int:
    """Number of tokens the prompt cache covers (the KV caches' common offset).

    Raises ``ValueError`` if the attention caches disagree (a half-updated
    cache must never be stored) or if there is no attention cache at all (a
    pure recurrent model has no position counter: the caller must know).
    """
    offsets = set()
    for c in K.leaves(prompt_cache):
        kind = K.find(c)
        o = None if kind is None else kind.offset(c)
        if o is not None:
            offsets.add(o)
    if len(offsets) > 1:
        raise ValueError(f"cache layers disagree on the token count: {sorted(offsets)}")
    if not offsets:
        raise ValueError("no attention cache to read the token count from")
    return offsets.pop()


def _flatten(c: Any, where: str, out: list[Layer], length: Optional[int], copy: bool) -> None:
    if type(c) is C.KVCache and not copy and c.keys is not None and c.keys.shape[0] == 1 \
            and (length is None or length <= c.offset):
        # the common leaf as its CacheClass reads it, without its general checks (a put's hot loop)
        out.append(K.kv(c.keys, c.values, c.offset if length is None else length, copy=False))
        return
    K.of(c, where).read(c, where, length, copy, out)


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
    return sum(1 for _ in K.leaves(C.make_prompt_cache(model)))


def caches_to_layers(parts: Sequence[Sequence[Any]], *, copy: bool = True) -> tuple[int, list[Layer]]:
    """The layers of several models' prompt caches as one list, and the
    tokens they cover: a main model's and its draft's (speculative decoding),
    cut to the tokens every part holds (a draft can be one token behind)."""
    n = min(cache_offset(p) for p in parts)
    return n, ([l for p in parts for l in cache_to_layers(p, length=n, copy=copy)] if n else [])


# ---------------------------------------------------------------------------
# layers -> engine cache
# ---------------------------------------------------------------------------


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
    cur = K.Cursor(layers)
    out = [K.of(t, f"layer {i}").build(t, cur, length, quant, f"layer {i}") for i, t in enumerate(template)]
    if cur.i != len(cur.layers):
        raise ValueError(
            f"got {len(cur.layers)} layers but the model's cache layout has {cur.i}"
        )
    mx.eval([a for c in out for a in K.of(c).arrays(c)])
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
