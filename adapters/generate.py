"""Generation on the store: fetch -> prefill the rest -> generate -> put.

``stream_generate`` / ``generate`` wrap mlx-lm's own functions of the same
name. The prompt's longest stored prefix comes back as ready mlx-lm cache
objects; only the rest is prefilled. Models whose cache cannot be trimmed
(recurrent state, sliding windows) are prefilled in chunks that end on block
boundaries and the cache is offered to the store at each boundary, so a later
prompt that shares only part of this one still finds a snapshot to start from.
"""

from __future__ import annotations

import importlib
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.generate import stream_generate as _mlx_stream_generate
from mlx_lm.models import cache as C

from kvstore import Hit, PrefixStore
from kvstore.blocks.hashing import as_tokens

from .calibration import calibrate, calibrate_once
from .fingerprints import adapter_fingerprint, loaded_model_fingerprint, model_fingerprint
from .gguf import gguf_fingerprint, is_gguf
from .mlx_lm import caches_to_layers, layers_to_caches
from .model_source import describe, loaded_from, watch_loads
from .request_log import log_request

_G = importlib.import_module("mlx_lm.generate")  # the module (the package's attribute of that name is the function)
watch_loads()  # models mlx-lm loads from now on say which files they came from: they key by them (model_key)

__all__ = ["model_key", "named_key", "models_key", "fetch_cache", "prefill", "store_cache", "stream_generate",
           "generate", "Generation", "calibrate", "calibrate_once", "calibrate_at_load"]

# id(model) -> {resolved model folder or None: key}; modules are dicts, hence unhashable
_KEYS: dict[int, dict[Optional[str], str]] = {}


def model_key(model: nn.Module, model_path: Union[str, Path, None] = None, extra: str = "") -> str:
    """The store key of a loaded model, the same whichever engine loaded it:
    its folder's (or GGUF file's) fingerprint, with its adapter's, when the
    files are known (``model_path``, else the folder mlx-lm's load recorded:
    ``model_source``), else a digest of the loaded model itself
    (``loaded_model_fingerprint``), never a name. Files written since the
    load began, or a model changed since (quantized after loading), key by
    the loaded bytes. Remembered per model and folder, so the answer never
    depends on which call came first."""
    recorded = getattr(model, "_kvstore_source", None)
    memo = str(Path(model_path).resolve()) if model_path is not None else None
    known = _KEYS.get(id(model), {})
    if extra == "" and memo in known:
        return known[memo]
    folder = memo if memo is not None else recorded and str(recorded.folder)
    source = loaded_from(model)
    if recorded is not None and folder == str(recorded.folder) and source is None:
        folder = None  # its files were written since it loaded, or it changed since (quantized...)
    adapter = source.adapter if source is not None and folder == str(source.folder) else None
    more = extra + ((";" if extra else "") + f"adapter={adapter_fingerprint(adapter)}" if adapter else "")
    if folder is not None and Path(folder, "config.json").is_file():
        key = model_fingerprint(folder, model, more)
    elif folder is not None and is_gguf(folder):
        key = gguf_fingerprint(folder, model, more)
    else:
        key = loaded_model_fingerprint(model, extra)
    if extra == "":
        if id(model) not in _KEYS:
            _KEYS[id(model)] = {}
            weakref.finalize(model, _KEYS.pop, id(model), None)
        _KEYS[id(model)][memo] = key
    return key


_NAMED: set[tuple[int, str]] = set()  # (id(store), key) described already


def named_key(store: PrefixStore, model: nn.Module, model_path: Union[str, Path, None] = None, *,
              draft_model: Optional[nn.Module] = None) -> str:
    """``models_key``, with the model described in ``store`` on first use (its
    folder's path and name, where files are known) so ``kvstore inspect``
    shows it by name whichever engine stored it first."""
    key = models_key(model, model_path, draft_model=draft_model)
    if (id(store), key) not in _NAMED:
        _NAMED.add((id(store), key))
        source = loaded_from(model) if model_path is None else None
        folder = Path(model_path) if model_path is not None else source and source.folder
        if folder is not None:
            store.register_model(key, describe(folder))
    return key


def models_key(model: nn.Module, model_path: Union[str, Path, None] = None, *, draft_model: Optional[nn.Module] = None,
               extra: str = "") -> str:
    """The store key of a model, or of a model and its draft model
    (speculative decoding): both caches are stored together, one chain whose
    blocks hold the main model's layers then the draft's, so the key
    fingerprints both. The draft is fingerprinted by its loaded weights
    wherever it came from, so ``kvstore serve`` (which knows its folder) and
    ``generate`` (which gets the model only) share its entries. Without a
    draft it is ``model_key(model, model_path)``."""
    if draft_model is not None:
        extra += (";" if extra else "") + f"draft={model_key(draft_model)}"
    return model_key(model, model_path, extra)


def _split(cache: Sequence[Any], model: nn.Module, draft_model: Optional[nn.Module]) -> list[Sequence[Any]]:
    """mlx-lm keeps a main model's and its draft's caches in one list."""
    if draft_model is None:
        return [cache]
    n = len(C.make_prompt_cache(model))
    return [cache[:n], cache[n:]]


def needs_snapshots(cache: Sequence[Any]) -> bool:
    """Whether the cache holds state a later, shorter prefix cannot trim back to."""
    def leaf(c):
        if isinstance(c, C.CacheList):
            return any(leaf(s) for s in c.caches)
        return not isinstance(c, (C.KVCache, C.QuantizedKVCache))
    return any(leaf(c) for c in cache)


@dataclass
class Restored:
    cache: list
    cached_tokens: int
    ram_tokens: int = 0
    ssd_tokens: int = 0
    remote_tokens: int = 0
    hit: Optional[Hit] = None


def fetch_cache(store: PrefixStore, model: nn.Module, key: str, tokens: Sequence[int], *,
                kv_bits: Optional[int] = None, kv_group_size: int = 64, quantized_kv_start: int = 0,
                max_kv_size: Optional[int] = None, draft_model: Optional[nn.Module] = None) -> Restored:
    """A prompt cache for ``tokens``: the longest stored prefix (leaving at
    least the last token to compute, so the engine gets its logits), or an
    empty cache on a miss. With a ``draft_model`` (and the key of
    :func:`models_key`) it holds the main model's caches, then the draft's.
    Under ``fetch_policy="auto"``, a model the store knows no prefills of is
    calibrated first (:func:`calibrate_once`)."""
    models = [model] if draft_model is None else [model, draft_model]
    calibrate_once(store, key, models)
    quant = (kv_bits, kv_group_size) if kv_bits else None
    hit = store.fetch(key, tokens, limit=len(tokens) - 1, quantized=quant)
    log_request(len(tokens), hit)
    if not hit:  # (the miss handed over too: its reasons, ``hit.not_served``)
        return Restored([c for m in models for c in C.make_prompt_cache(m, max_kv_size=max_kv_size)], 0, hit=hit)
    cache = layers_to_caches(hit.layers, models, length=hit.length, kv_bits=kv_bits, kv_group_size=kv_group_size,
                             quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    return Restored(cache, hit.length, hit.ram_tokens, hit.ssd_tokens, hit.remote_tokens, hit)


def store_cache(store: PrefixStore, key: str, tokens: Sequence[int], cache: Sequence[Any], *,
                parts: Optional[Sequence[Sequence[Any]]] = None) -> int:
    """Offer ``cache`` (which covers a prefix of ``tokens``) to the store;
    ``parts``: the caches of a main model and its draft instead.

    The store takes the cache's buffers as they are, with ``KVLayer(rows=n)``
    (new array objects on them: ``put`` keeps the values of the moment
    whatever the engine writes later): the caller waits for no copy of its KV
    and builds no slice to evaluate, and the buffers are held only until the
    blocks are written. Pass tokens as an int32 array where you have one: a
    Python list is converted first."""
    n, layers = caches_to_layers(parts if parts is not None else [cache], copy=False)
    if n == 0:
        return 0
    return store.put(key, tokens[:n], layers)


def prefill(model: nn.Module, cache: list, tokens: Sequence[int], start: int, stop: int, *,
            store: Optional[PrefixStore] = None, key: Optional[str] = None, step: int = 2048,
            kv_bits: Optional[int] = None, kv_group_size: int = 64, quantized_kv_start: int = 0) -> None:
    """Run ``tokens[start:stop]`` through the model into ``cache``.

    With a store and a cache that cannot be trimmed, chunks end on the store's
    block boundaries and each boundary's cache is offered to the store.
    """
    snapshots = store is not None and needs_snapshots(cache)
    bs = store.block_size if store is not None else step
    pos = start
    with mx.stream(_G.generation_stream):  # read now: vllm-mlx rebinds it to a stream of its model thread
        while pos < stop:
            end = min(stop, pos + step)
            if snapshots:
                end = min(stop, (pos // bs + 1) * bs)
            model(mx.array(tokens[pos:end])[None], cache=cache)
            maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
            mx.eval([c.state for c in cache])
            pos = end
            if snapshots and pos % bs == 0:
                store_cache(store, key, tokens, cache)


def calibrate_at_load(store: PrefixStore, model: nn.Module, model_path: Union[str, Path, None] = None, *,
                      draft_model: Optional[nn.Module] = None) -> float:
    """``calibrate_once`` for what ``stream_generate`` will be asked to run,
    called once the model is loaded and before any prompt (``kvstore
    generate``), so no request waits on it; its seconds."""
    key = models_key(model, model_path, draft_model=draft_model)
    return calibrate_once(store, key, [model] if draft_model is None else [model, draft_model])


@dataclass
class Generation:
    """What one request did: text, token counts, where the prompt came from."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the store (OpenAI's cached_tokens)
    ram_tokens: int = 0
    ssd_tokens: int = 0
    remote_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float = 0.0  # prompt arrival to first generated token (less calibrate_s)
    calibrate_s: float = 0.0  # once per model and store: timed prefills within ``calibrate_budget_s`` (``calibrate_once``)
    total_s: float = 0.0
    finish_reason: Optional[str] = None


def _tokens(tokenizer, prompt: Union[str, Sequence[int], mx.array]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, mx.array):
        return prompt.tolist()
    return list(prompt)


def stream_generate(model: nn.Module, tokenizer, prompt: Union[str, Sequence[int]], *, store: PrefixStore,
                    model_path: Union[str, Path, None] = None, max_tokens: int = 256,
                    kv_bits: Optional[int] = None, kv_group_size: int = 64, quantized_kv_start: int = 0,
                    max_kv_size: Optional[int] = None, prefill_step_size: int = 2048,
                    result: Optional[Generation] = None, **kwargs) -> Iterator[Any]:
    """mlx-lm's ``stream_generate`` with the prompt cache taken from and given
    back to ``store``. Yields mlx-lm ``GenerationResponse`` objects, each with
    ``cached_tokens`` set; pass ``result=Generation()`` to get the totals."""
    t0 = time.perf_counter()
    res = result if result is not None else Generation()
    tokens = _tokens(tokenizer, prompt)
    if not tokens:
        raise ValueError("empty prompt")
    ids = as_tokens(tokens)  # the store's form, made once for the fetch and the put (a 32K list: about 1 ms)
    draft = kwargs.get("draft_model")  # speculative decoding: its cache is stored with the main model's
    key = named_key(store, model, model_path, draft_model=draft)
    qkw = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    # set-up, as loading the model is: the server does it at load, here the first request does (not in ttft_s)
    res.calibrate_s = calibrate_once(store, key, [model] if draft is None else [model, draft])
    t_fetch = time.perf_counter()
    got = fetch_cache(store, model, key, ids, max_kv_size=max_kv_size, draft_model=draft, **qkw)
    cache = got.cache
    res.prompt_tokens, res.cached_tokens = len(tokens), got.cached_tokens
    res.ram_tokens, res.ssd_tokens, res.remote_tokens = got.ram_tokens, got.ssd_tokens, got.remote_tokens
    res.computed_tokens = len(tokens) - got.cached_tokens
    pos = got.cached_tokens
    if draft is None and needs_snapshots(cache):  # speculative decoding needs trimmable caches anyway
        prefill(model, cache, tokens, pos, len(tokens) - 1, store=store, key=key, step=prefill_step_size, **qkw)
        pos = len(tokens) - 1
    generated: list[int] = []
    try:
        for resp in _mlx_stream_generate(model, tokenizer, tokens[pos:], max_tokens=max_tokens, prompt_cache=cache,
                                         prefill_step_size=prefill_step_size, **qkw, **kwargs):
            if not generated:
                now = time.perf_counter()
                res.ttft_s = now - t0 - res.calibrate_s
                # what this request cost from fetch to first token: the store learns prefill and the
                # real cost of its hits from it (on a GPU, arrays move to the device in the first forward)
                store.observe_request(key, len(tokens), got.hit, now - t_fetch)
            generated.append(resp.token)
            res.text += resp.text
            res.finish_reason = resp.finish_reason
            resp.cached_tokens = got.cached_tokens
            yield resp
    finally:
        res.tokens = generated
        res.total_s = time.perf_counter() - t0
        store_cache(store, key, np.concatenate([ids, as_tokens(generated)]), cache,
                    parts=_split(cache, model, draft))


def generate(model: nn.Module, tokenizer, prompt: Union[str, Sequence[int]], *, store: PrefixStore,
             **kwargs) -> Generation:
    """``stream_generate`` run to the end; returns the text and the counts."""
    res = Generation()
    for _ in stream_generate(model, tokenizer, prompt, store=store, result=res, **kwargs):
        pass
    return res
