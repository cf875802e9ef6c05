"""``kvstore run``'s instrumentation of mlx-lm (imported in the engine's
process once ``mlx_lm.generate`` is: see :mod:`kvstore.adapters.run`).

It replaces ``mlx_lm.generate.generate_step``, which ``stream_generate`` and
``generate`` call for every request without a draft model. Per call:

1. The tokens the engine's prompt cache already holds: none for a fresh
   cache; for a cache this process handed to an earlier call (an engine that
   keeps its cache and trims it to the common prefix, as mlx-lm's server,
   mlx-omni-server and mlx-openai-server do) the tokens recorded then, cut to
   the cache's offset, if the cache still holds those rows (a per-token
   checksum of its first attention layer). A cache filled some other way is
   left alone: the call runs as mlx-lm's own, nothing fetched or stored.
2. Where the store holds a block or more of ``held + prompt`` past the cache, the cache
   list's items are replaced (in place: the engine keeps its list) by the
   store's (``generate.fetch_cache``); only the rest is prefilled, and caches
   that cannot be trimmed (hybrid, sliding windows) get the store's block
   snapshots (``generate.prefill``).
3. When the engine stops reading, what the cache covers (prompt and
   generated tokens) is offered to the store (``generate.store_cache``).

The model key is ``generate.model_key(model)``: a digest of the loaded
model's config and weights, so no other model is ever served this KV.
Not covered: ``speculative_generate_step`` (a draft model), ``BatchGenerator``
and ``input_embeddings``; those calls run as mlx-lm's own.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from kvstore import PrefixStore
from kvstore.config import store_config
from kvstore.hashing import as_tokens

from .calibration import calibrate_once
from .generate import fetch_cache, model_key, needs_snapshots, prefill, store_cache
from .mlx_lm import cache_offset, layout_signature

log = logging.getLogger("kvstore.run")

STORE_ENV = "KVSTORE_RUN_STORE"  # the store's settings (StoreConfig fields), JSON
REPORT_ENV = "KVSTORE_RUN_REPORT"  # a file: one JSON line per request

_lock = threading.Lock()
_store: Optional[PrefixStore] = None


def open_store() -> PrefixStore:
    """The process's store, opened on its first request from ``$KVSTORE_RUN_STORE``
    and closed (pending blocks written) at exit."""
    global _store
    with _lock:
        if _store is None:
            _store = PrefixStore(store_config(**json.loads(os.environ.get(STORE_ENV) or "{}")))
            atexit.register(_store.close)
        return _store


@dataclass
class _Held:
    tokens: list[int]
    sums: Optional[np.ndarray]  # per-token checksums of the first attention layer's keys


_HELD: "weakref.WeakKeyDictionary[Any, _Held]" = weakref.WeakKeyDictionary()  # cache[0] -> what it holds


def _checksums(cache: list, n: int) -> Optional[np.ndarray]:
    """One number per cached token (float64 sums of layer keys' rows), or None
    where the first attention layer is not a plain or quantized KV cache."""
    for c in cache:
        if isinstance(c, (C.KVCache, C.QuantizedKVCache)) and c.keys is not None:
            k = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
            rows = np.array(k[..., :n, :].astype(mx.float32) if k.dtype == mx.bfloat16 else k[..., :n, :])
            return rows.astype(np.float64).sum(axis=(0, 1, 3))
        if not isinstance(c, (C.KVCache, C.QuantizedKVCache)):
            return None
    return None


def _held(cache: list) -> Optional[list[int]]:
    """Tokens the cache holds, or None where this process cannot vouch for them."""
    try:
        n = cache_offset(cache)
    except ValueError:
        return None
    if n == 0:
        return []
    held = _HELD.get(cache[0])
    if held is None or n > len(held.tokens):
        return None
    if held.sums is None:
        return held.tokens if n == len(held.tokens) else None
    now = _checksums(cache, n)
    return held.tokens[:n] if now is not None and np.array_equal(now, held.sums[:n]) else None


def _remember(cache: list, tokens: list[int]) -> None:
    try:
        n = cache_offset(cache)
    except ValueError:
        return
    if n <= len(tokens):
        _HELD[cache[0]] = _Held(tokens[:n], _checksums(cache, n))
    else:
        _HELD.pop(cache[0], None)


def _report(**fields) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def instrument(generate_step: Callable) -> Callable:
    """``generate_step`` with its prompt cache taken from and given back to the store."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    def step(prompt, model, *args, **kwargs):
        cache = kwargs.get("prompt_cache")
        if cache is None:
            cache = kwargs["prompt_cache"] = C.make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size"))
        ours = isinstance(cache, list) and kwargs.get("input_embeddings") is None and len(prompt) > 0
        held = _held(cache) if ours else None
        if held is None:  # not ours to vouch for: mlx-lm's own call
            yield from generate_step(prompt, model, *args, **kwargs)
            return
        store = open_store()
        tokens = held + np.asarray(prompt).reshape(-1).tolist()
        ids = as_tokens(tokens)
        key = model_key(model)
        calibrate_s = calibrate_once(store, key, [model])  # once per model: set-up, not this request's time
        t0 = time.perf_counter()
        qkw = dict(kv_bits=kwargs.get("kv_bits"), kv_group_size=kwargs.get("kv_group_size", 64),
                   quantized_kv_start=kwargs.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START))
        hit, pos = None, len(held)
        # loading re-reads the prefix the engine holds too: worth it for a whole block or more past it
        if store.contains(key, ids[:-1]) >= pos + store.block_size:
            got = fetch_cache(store, model, key, ids, max_kv_size=kwargs.get("max_kv_size"), **qkw)
            if got.cached_tokens > pos and layout_signature(got.cache) == layout_signature(cache):
                cache[:] = got.cache  # the engine's own list: it keeps what the store served
                hit, pos = got.hit, got.cached_tokens
        from_store = pos - len(held)
        if needs_snapshots(cache) and pos < len(tokens) - 1:
            prefill(model, cache, tokens, pos, len(tokens) - 1, store=store, key=key,
                    step=kwargs.get("prefill_step_size", 2048), **qkw)
            pos = len(tokens) - 1
        generated: list[int] = []
        try:
            for y, logprobs in generate_step(mx.array(tokens[pos:]), model, *args, **kwargs):
                if not generated:
                    ttft = time.perf_counter() - t0
                    store.observe_request(key, len(tokens), hit, ttft)
                    _report(prompt_tokens=len(tokens), engine_tokens=len(held), store_tokens=from_store,
                            computed_tokens=len(tokens) - len(held) - from_store, ttft_s=ttft, calibrate_s=calibrate_s,
                            model=key[:12])
                generated.append(int(y))
                yield y, logprobs
        finally:
            known = tokens + generated
            if cache_offset(cache) <= len(known):
                store_cache(store, key, np.concatenate([ids, as_tokens(generated)]), cache)
            _remember(cache, known)

    step.__wrapped__ = generate_step
    step.__doc__ = generate_step.__doc__
    return step
