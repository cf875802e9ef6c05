"""``StorePromptCache``: the interface ``mlx_lm.server`` expects of its
``LRUPromptCache`` (``fetch_nearest_cache``, ``insert_cache``, ``trim_to``,
``nbytes``, ``__len__``, ``stats_by_type``) over a ``PrefixStore``. Every
request the server caches is cached here too: text, prompts with images (keyed
by mlx-lm's ``Vision.cache_key``, whose patch tokens are negative 64-bit ids)
and speculative decoding (main and draft model cached together).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as C

from kvstore import Hit, PrefixStore

from .file_digests import changed_since
from .fingerprints import adapter_fingerprint
from .generate import calibrate_once, models_key, needs_snapshots, prefill
from .gguf import TRAINED, is_gguf, resolve_model
from .inserts import Inserts
from .mlx_lm import cache_offset, layers_to_caches, snapshot
from .model_source import key_files, loaded_from
from .request_log import log_request

__all__ = ["StorePromptCache"]

log = logging.getLogger("kvstore")


@dataclass
class _Models:
    """What the server runs under one of its model keys: the store key (see
    ``models_key``: with a draft model, main and draft caches are stored
    together) and the models whose caches make up its prompt cache, main
    model first, with how many top-level entries each has in mlx-lm's list."""

    key: str
    models: list[nn.Module]
    top: list[int]

    def split(self, prompt_cache: Sequence[Any]) -> list[Sequence[Any]]:
        if len(prompt_cache) != sum(self.top):
            raise ValueError(f"the prompt cache has {len(prompt_cache)} entries; the models make {sum(self.top)}")
        out, i = [], 0
        for n in self.top:
            out.append(prompt_cache[i : i + n])
            i += n
        return out


def _starts_alike(a: Sequence[int], b: Sequence[int], block: int) -> bool:
    """Whether two prompts share their start (up to a block, or the whole shorter one but its last token)."""
    k = min(len(a), len(b) - 1, block)
    return k > 0 and list(a[:k]) == list(b[:k])


def _whole_images(tokens: Sequence[int], n: int) -> int:
    """``n``, or the start of the image whose patch tokens it ends inside.

    mlx-lm's server gives every patch token of one image the same negative id
    and feeds an image's pixels only when its first patch token is past the
    cached prefix: a prefix ending mid-image would leave the image's other
    patch tokens without pixels."""
    if 0 < n < len(tokens) and tokens[n] < 0 and tokens[n - 1] == tokens[n]:
        image = tokens[n]
        while n > 0 and tokens[n - 1] == image:
            n -= 1
    return n


class StorePromptCache:
    """``LRUPromptCache``'s interface over a ``PrefixStore``.

    ``model_provider`` is mlx-lm's ``ModelProvider``: the store needs the
    loaded models to rebuild their cache classes and to fingerprint them (the
    server's own key is a path or a hub name, which says nothing of the
    weights behind it).
    """

    OPEN_WAIT = 5.0  # seconds a fetch waits at most for another thread's open request to insert its cache

    def __init__(self, store: PrefixStore, model_provider: Any):
        self.store = store
        self.provider = model_provider
        self._models: dict[Any, Optional[_Models]] = {}
        self._inserts = Inserts(store)
        # per thread, the request it fetched for and has not inserted yet: (model key, its tokens)
        self._open: dict[int, tuple[str, list]] = {}
        self._inserters: set[int] = set()  # threads that insert caches (mlx-lm's generation thread)
        self._open_cond = threading.Condition()

    # -- the server's interface ---------------------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Optional[list], list[int]]:
        m = self._resolve(model)
        if m is None or len(tokens) < 2:
            return None, tokens
        args = self.provider.cli_args
        kv_bits = getattr(args, "kv_bits", None)
        group = getattr(args, "kv_group_size", 64)
        self._wait_open(m.key, tokens)
        self._inserts.wait(m.key)
        qkw = dict(kv_bits=kv_bits, kv_group_size=group, quantized_kv_start=getattr(args, "quantized_kv_start", 0))
        try:
            hit = self._fetch(m.key, tokens, (kv_bits, group) if kv_bits else None)
            cache = layers_to_caches(hit.layers, m.models, length=hit.length, **qkw) if hit else None
            cache, length = self._snapshot_blocks(m, tokens, cache, hit.length, qkw)
        except Exception:
            log.exception("kvstore: restoring a cache failed; computing the prompt instead")
            return None, tokens
        return (None, tokens) if cache is None else (cache, tokens[length:])

    def _snapshot_blocks(self, m: "_Models", tokens: list[int], cache: Optional[list], start: int,
                         qkw: dict) -> tuple[Optional[list], int]:
        """For a model with recurrent layers (their state cannot be trimmed
        back to a shorter prefix): compute the prompt's whole blocks past
        ``start`` here, on the generation thread before mlx-lm's own prefill,
        offering the cache to the store at each block boundary (as
        ``generate`` does), so a later prompt sharing only a system prompt
        finds a snapshot; mlx-lm goes on from there. ``(cache, start)`` as
        given where there is nothing to do: attention-only models, a draft
        model (its caches stay trimmable anyway), image prompts (their patch
        tokens need pixels)."""
        model, bs = m.models[0], self.store.block_size
        stop = (len(tokens) - 1) // bs * bs  # the engine computes at least the last token
        if len(m.models) > 1 or stop <= start or min(tokens) < 0 or getattr(model, "vision_tower", None) is not None:
            return cache, start
        work = cache if cache is not None else C.make_prompt_cache(model)
        if not needs_snapshots(work):
            return cache, start
        prefill(model, work, tokens, start, stop, store=self.store, key=m.key, step=bs, **qkw)
        return work, stop

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list, *, cache_type: str = "assistant"):
        """Hand the cache to the store. ``cache_type`` (mlx-lm's eviction
        order) has no use here: blocks shared by a system prompt, a user turn
        and an answer are one pool, evicted leaves first."""
        try:
            self._insert(model, tokens, prompt_cache)
        finally:  # this thread's request is done (its insert is in flight): fetches waiting for it go on
            with self._open_cond:
                self._open.pop(threading.get_ident(), None)
                self._inserters.add(threading.get_ident())
                self._open_cond.notify_all()

    def _insert(self, model: Any, tokens: list[int], prompt_cache: list) -> None:
        m = self._resolve(model)
        if m is None:
            return
        try:
            n = min(cache_offset(p) for p in m.split(prompt_cache))  # a draft may be one token behind its main model
            if n == 0:
                return
            frozen, arrays = snapshot(prompt_cache)
            mx.async_eval(arrays)  # what the engine left unevaluated is scheduled on its stream; no wait
        except Exception:
            log.exception("kvstore: storing a cache failed; it is skipped")
            return
        self._inserts.submit(m.key, list(tokens[:n]), m.split(frozen), arrays)

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """The server asks to stay under ``n_bytes`` while requests hold
        caches: evict RAM blocks down to it (SSD copies stay). The store is
        bounded by bytes only, so ``n_sequences`` is not used."""
        if n_bytes is not None:
            self._inserts.wait()  # what is being inserted counts too
            self.store.trim_ram(max(0, n_bytes))

    @property
    def nbytes(self) -> int:
        """Bytes of KV held in RAM (what counts against the server's memory)."""
        return self.store.nbytes

    def __len__(self) -> int:
        """Stored entries, as ``kvstore inspect`` lists them: chains of blocks
        from a model's root to a leaf (a prompt, or a prompt and its answer)."""
        return self.store.sequences

    def stats_by_type(self) -> dict:
        """One entry, ``all``: the store does not keep mlx-lm's cache types
        apart (a system prompt's blocks are the start of every turn after it)."""
        return {"all": {"n_sequences": len(self), "n_bytes": self.nbytes}}

    # -- ours -----------------------------------------------------------------

    def prepare(self, model: Any) -> None:
        """Resolve the server's model key ``model`` now (its store key, its
        folder registered, its prefills calibrated): at load, before the
        server answers, so no request waits on it. A model a request asks
        for later is resolved at its first request."""
        self._resolve(model)

    def flush(self) -> None:
        """Wait until every insert so far is in the store, encoded and written."""
        self._inserts.wait()
        self.store.flush()

    def close(self) -> None:
        """Finish the inserts in flight (the store stays open)."""
        self._inserts.close()

    def _wait_open(self, key: str, tokens: list[int]) -> None:
        """Wait (at most ``OPEN_WAIT``) while another thread has a request of
        this model open whose prompt starts as ``tokens`` do, then mark this
        thread's own request open. mlx-lm's generation thread sends a
        response's end before it inserts the cache, so a client that fetches
        the moment the response ends (mlx-lm's own tests do) would otherwise
        miss the cache about to be inserted. Only threads that insert (or,
        before any has, every thread) are waited for: a client's own fetches
        never hold up the generation thread. The generation thread never
        waits for itself; a request that never inserts (it failed) is waited
        for once, then forgotten."""
        me = threading.get_ident()
        deadline = time.monotonic() + self.OPEN_WAIT
        with self._open_cond:
            while True:
                alive = {t.ident for t in threading.enumerate()}
                waiting = [t for t, (k, prompt) in self._open.items()
                           if t != me and t in alive and (t in self._inserters or not self._inserters)
                           and k == key and _starts_alike(prompt, tokens, self.store.block_size)]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    for t in waiting:  # (never inserted: not waited for again)
                        del self._open[t]
                    break
                self._open_cond.wait(left)
            self._open[me] = (key, list(tokens))

    def _fetch(self, key: str, tokens: list[int], quantized: Optional[tuple[int, int]]) -> Hit:
        limit = len(tokens) - 1  # the engine computes at least the last token, for its logits
        while True:
            hit = self.store.fetch(key, tokens, limit=limit, quantized=quantized)
            whole = _whole_images(tokens, hit.length)
            if whole == 0 < hit.length:  # it ends inside the first image: nothing of it is usable (a limit of ours)
                hit = Hit(not_served={**hit.not_served, "limit": hit.not_served.get("limit", 0) + hit.length})
            if whole == hit.length:
                log_request(len(tokens), hit)
                return hit
            limit = whole

    def _resolve(self, model: Any) -> Optional[_Models]:
        """What the server's model key (path, adapter, draft) stands for;
        ``None`` while its models are not loaded."""
        if model in self._models:
            return self._models[model]
        provider = self.provider
        path, adapter, draft = (tuple(model) + (None, None, None))[:3] if isinstance(model, tuple) else (model, None, None)
        if provider.model is None or (draft is not None and getattr(provider, "draft_model", None) is None):
            return None
        models = [provider.model] if draft is None else [provider.model, provider.draft_model]
        local, draft_local = folder_of(path), folder_of(draft)
        key = _loaded_key(provider.model, local, adapter, models[1] if draft is not None else None)
        if local:
            info = {"path": str(local.resolve()), "name": local.name}
            if draft is not None:
                info["draft"] = str(draft_local.resolve()) if draft_local else str(draft)
            self.store.register_model(key, info)
        m = _Models(key, models, [len(C.make_prompt_cache(x)) for x in models])
        self._models[model] = m
        calibrate_once(self.store, key, models)  # the server's prefills cannot be timed from here (at load: prepare)
        return m


def folder_of(path: Any) -> Optional[Path]:
    """``path`` when it is a local model folder or GGUF file (not a hub name)."""
    if path is None:
        return None
    if str(path) in TRAINED:
        return resolve_model(path)
    local = Path(str(path)).expanduser()
    return local if (local / "config.json").is_file() or is_gguf(local) else None


def _loaded_key(model: nn.Module, local: Optional[Path], adapter: Optional[str],
                draft_model: Optional[nn.Module]) -> str:
    """The store key of what the server loaded: by its files' content (each
    file's digest remembered: a restart reads no weights) where they are local
    and unchanged since the load began, else by the loaded model itself: a hub
    name, or files written since (an adapter retrained while serving must not
    key the old weights' KV by the new file)."""
    loaded = getattr(model, "_kvstore_loaded_ns", None)
    if local is None or loaded is None or changed_since(key_files(local, adapter and Path(adapter)), loaded):
        return models_key(model, None, draft_model=draft_model)  # the files its load recorded, if any (hub)
    recorded = loaded_from(model) is not None  # mlx-lm's load recorded the adapter: model_key adds it
    return models_key(model, local, draft_model=draft_model,
                      extra=f"adapter={adapter_fingerprint(adapter)}" if adapter and not recorded else "")
