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

It also wraps ``mlx_lm.generate.BatchGenerator`` (continuous batching, as
mlx-lm's server uses it) with :func:`instrument_batch`:

1. ``insert_segments`` (``insert`` calls it): for each prompt whose cache is
   fresh (none given, or empty) or holds exactly the ``all_tokens`` the
   engine says it holds (mlx-lm's server passes the prefix its LRU cache
   served), where the store holds a block or more of ``all_tokens + prompt``
   past it, the generator gets the store's cache (a new list: the engine's is
   not touched) with ``all_tokens`` extended to match, and only the rest of
   the prompt (at least one token), as mlx-lm's server does after its own
   cache lookup.
2. ``_next`` (``next`` and ``next_generated`` call it): a finished
   sequence's cache, handed back as ``prompt_cache`` / ``all_tokens``, is
   evaluated on the engine's thread and offered to the store (a put queues
   the write; it never waits for it).

Left to mlx-lm's own behaviour: a generator made with ``max_kv_size``,
caches that cannot be trimmed (recurrent state, sliding windows: no block
snapshots are taken inside a batch), a cache given without ``all_tokens``
naming what it holds, and sequences ``remove``d before they finish (nothing
stored). An mlx-lm whose ``BatchGenerator`` lacks what this relies on
(:func:`batch_mismatch`) keeps its own, with a warning on stderr.

The model key is ``generate.model_key(model)``: the content of the files
mlx-lm's load read (``model_source`` records them), as ``kvstore generate``
and ``kvstore serve`` key the same folder, or a digest of the loaded model's
config and weights where no files are known; no other model is ever served
this KV.
Not covered: ``speculative_generate_step`` (a draft model) and
``input_embeddings``; those calls run as mlx-lm's own.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import json
import logging
import os
import sys
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
from kvstore.blocks.hashing import as_tokens

from .calibration import calibrate_once
from .fingerprints import layout_signature
from .generate import fetch_cache, named_key, needs_snapshots, prefill, store_cache
from .mlx_lm import cache_offset

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


def _past(store: PrefixStore, model, key: str, ids: np.ndarray, pos: int, like: Callable[[], list], **kw):
    """``fetch_cache``'s result for ``ids`` where the store serves more than
    the ``pos`` tokens the engine's cache holds, in the layout of ``like()``
    (the cache the engine would use); None otherwise. Loading re-reads the
    prefix the engine holds too: asked only for a whole block or more past it."""
    if store.contains(key, ids[:-1]) < pos + store.block_size:
        return None
    got = fetch_cache(store, model, key, ids, **kw)
    return got if got.cached_tokens > pos and layout_signature(got.cache) == layout_signature(like()) else None


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
        key = named_key(store, model)
        calibrate_s = calibrate_once(store, key, [model])  # once per model: set-up, not this request's time
        t0 = time.perf_counter()
        qkw = dict(kv_bits=kwargs.get("kv_bits"), kv_group_size=kwargs.get("kv_group_size", 64),
                   quantized_kv_start=kwargs.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START))
        hit, pos = None, len(held)
        got = _past(store, model, key, ids, pos, lambda: cache, max_kv_size=kwargs.get("max_kv_size"), **qkw)
        if got is not None:
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


# ---------------------------------------------------------------------------
# BatchGenerator (continuous batching)
# ---------------------------------------------------------------------------

_INSERT_PARAMS = ["self", "segments", "max_tokens", "caches", "all_tokens"]
_RESPONSE_FIELDS = {"uid", "finish_reason", "prompt_cache", "all_tokens"}


def batch_mismatch(module) -> Optional[str]:
    """What kvstore relies on in ``mlx_lm.generate``'s ``BatchGenerator`` and
    this mlx-lm lacks, or None: ``insert_segments(segments, max_tokens,
    caches, all_tokens, ...)``, ``_next()`` returning (prompt responses,
    generation responses), finished responses carrying ``prompt_cache`` and
    ``all_tokens``, and ``max_kv_size`` / ``model`` on the generator."""
    bg = getattr(module, "BatchGenerator", None)
    if bg is None:
        return "no BatchGenerator"
    try:
        params = list(inspect.signature(bg.insert_segments).parameters)
    except (AttributeError, TypeError, ValueError):
        return "no BatchGenerator.insert_segments"
    if params[: len(_INSERT_PARAMS)] != _INSERT_PARAMS:
        return f"BatchGenerator.insert_segments{tuple(params)} (expected {tuple(_INSERT_PARAMS)} first)"
    if not callable(getattr(bg, "_next", None)):
        return "no BatchGenerator._next"
    response = getattr(getattr(module, "GenerationBatch", None), "Response", None)
    try:
        fields = {f.name for f in dataclasses.fields(response)}
    except TypeError:
        return "no GenerationBatch.Response dataclass"
    if not _RESPONSE_FIELDS <= fields:
        return f"GenerationBatch.Response lacks {sorted(_RESPONSE_FIELDS - fields)}"
    init = inspect.signature(bg.__init__).parameters
    if "max_kv_size" not in init or "model" not in init:
        return "BatchGenerator.__init__ takes no model / max_kv_size"
    return None


@dataclass
class _Request:
    key: str
    t0: float
    prompt_tokens: int
    engine_tokens: int
    store_tokens: int
    calibrate_s: float
    hit: Any
    reported: bool = False


def _trimmable(gen) -> bool:
    """Whether the generator's model makes caches that can be trimmed (once per generator)."""
    if "_kvstore_trimmable" not in gen.__dict__:
        gen._kvstore_trimmable = not needs_snapshots(C.make_prompt_cache(gen.model))
    return gen._kvstore_trimmable


def _skip(segments: list, n: int) -> list:
    """``segments`` less their first ``n`` tokens (empty segments dropped)."""
    out = []
    for seg in segments:
        seg = list(seg)
        if n >= len(seg):
            n -= len(seg)
            continue
        out.append(seg[n:])
        n = 0
    return out


def _requests(gen) -> dict:
    return gen.__dict__.setdefault("_kvstore_requests", {})


def _serve(gen, segments: list, cache: Optional[list], held: Optional[list]):
    """(segments, cache, all_tokens, request) for one prompt: the rest of the
    prompt past what the cache holds once filled from the store (nothing
    added where ``request.store_tokens`` is 0), or None where the prompt is
    not ours (mlx-lm's own)."""
    if gen.max_kv_size is not None or not (cache is None or isinstance(cache, list)):
        return None
    if not _trimmable(gen) or (cache is not None and needs_snapshots(cache)):
        return None
    try:
        n = cache_offset(cache) if cache else 0
    except ValueError:
        return None
    held = [int(t) for t in held] if held is not None else []
    if len(held) != n:  # the engine does not say what its cache holds
        return None
    prompt = [int(t) for seg in segments for t in np.asarray(seg).reshape(-1).tolist()]
    if not prompt:
        return None
    store = open_store()
    tokens = held + prompt
    ids = as_tokens(tokens)
    key = named_key(store, gen.model)
    calibrate_s = calibrate_once(store, key, [gen.model])
    t0 = time.perf_counter()
    hit, pos = None, n
    got = _past(store, gen.model, key, ids, pos, lambda: cache if cache else C.make_prompt_cache(gen.model))
    if got is not None:
        cache, hit, pos = got.cache, got.hit, got.cached_tokens
    return _skip(segments, pos - n), cache, tokens[:pos], _Request(key, t0, len(tokens), n, pos - n, calibrate_s, hit)


def _offer(req: _Request, r) -> None:
    """A finished sequence's cache (``r.prompt_cache``, holding ``r.all_tokens``) to the store."""
    cache, tokens = r.prompt_cache, r.all_tokens
    if not cache or tokens is None:
        return
    try:
        n = cache_offset(cache)
    except ValueError:
        return
    if 0 < n <= len(tokens):
        mx.eval([c.state for c in cache])  # extract() hands back lazy slices of the batch's buffers
        store_cache(open_store(), req.key, as_tokens(list(tokens)), cache)


def instrument_batch(module) -> bool:
    """Wrap ``module.BatchGenerator`` (``insert_segments``, ``_next``,
    ``remove``) so its prompts are served from and offered to the store;
    False (and a warning) where this mlx-lm's differs from what kvstore knows."""
    bg = module.BatchGenerator
    if getattr(bg.insert_segments, "__wrapped__", None) is not None:
        return True
    why = batch_mismatch(module)
    if why is not None:
        sys.stderr.write(f"kvstore run: mlx-lm's BatchGenerator is not instrumented ({why}): "
                         "its requests run without the store\n")
        return False
    insert_segments, step, remove = bg.insert_segments, bg._next, bg.remove

    def insert(self, segments, max_tokens=None, caches=None, all_tokens=None, *args, **kwargs):
        k = len(segments)
        if (caches is not None and len(caches) != k) or (all_tokens is not None and len(all_tokens) != k):
            return insert_segments(self, segments, max_tokens, caches, all_tokens, *args, **kwargs)  # mlx-lm's error
        segs = list(segments)
        cs = list(caches) if caches is not None else [None] * k
        ts = list(all_tokens) if all_tokens is not None else [[] for _ in range(k)]
        reqs, hits = [], 0
        for i in range(k):
            served = _serve(self, segs[i], cs[i], ts[i])
            reqs.append(served[3] if served is not None else None)
            if served is not None and served[3].store_tokens > 0:  # the store's cache, the rest of the prompt
                segs[i], cs[i], ts[i] = served[:3]
                hits += 1
        if hits:
            uids = insert_segments(self, segs, max_tokens, cs, ts, *args, **kwargs)
        else:  # exactly the engine's call
            uids = insert_segments(self, segments, max_tokens, caches, all_tokens, *args, **kwargs)
        ours = _requests(self)
        for uid, req in zip(uids, reqs):
            if req is not None:
                ours[uid] = req
        return uids

    def next_(self):
        prompt_responses, generation_responses = step(self)
        ours = self.__dict__.get("_kvstore_requests")
        for r in generation_responses if ours else ():
            req = ours.get(r.uid)
            if req is None:
                continue
            if not req.reported:
                req.reported = True
                ttft = time.perf_counter() - req.t0
                store = open_store()
                store.observe_request(req.key, req.prompt_tokens, req.hit, ttft)
                _report(prompt_tokens=req.prompt_tokens, engine_tokens=req.engine_tokens,
                        store_tokens=req.store_tokens,
                        computed_tokens=req.prompt_tokens - req.engine_tokens - req.store_tokens, ttft_s=ttft,
                        calibrate_s=req.calibrate_s, model=req.key[:12], batch=True)
            if r.finish_reason is not None:
                del ours[r.uid]
                _offer(req, r)
        return prompt_responses, generation_responses

    def remove_(self, uids, *args, **kwargs):
        ours = self.__dict__.get("_kvstore_requests")
        for uid in uids if ours else ():
            ours.pop(uid, None)
        return remove(self, uids, *args, **kwargs)

    insert.__wrapped__, insert.__doc__ = insert_segments, insert_segments.__doc__
    next_.__wrapped__, remove_.__wrapped__ = step, remove
    bg.insert_segments, bg._next, bg.remove = insert, next_, remove_
    return True
