"""vllm-mlx's prefix-cache interfaces over a ``PrefixStore``: ``StorePrefixCache``
(the scheduler's ``MemoryAwarePrefixCache``) and ``StoreTrieCache`` (mlx-lm's
``LRUPromptCache`` as ``SimpleEngine`` uses it). :mod:`.vllm_mlx` checks the
installed vllm-mlx and puts them in place.

What the scheduler expects of the cache and how the store answers:

* ``fetch(tokens) -> (cache | None, remaining)``: the longest stored prefix
  that leaves at least the last token to compute, as fresh mlx-lm cache
  objects of batch 1, typed ``"prefix"`` (the scheduler drops ``"exact"`` and
  ``"supersequence"`` hits and prefills the whole prompt again).
  For a model whose cache cannot be cut back (recurrent state, sliding
  windows that wrapped) fetch also computes the prompt's whole blocks past the
  hit, offering a snapshot to the store at each block boundary, so prompts
  that share only a system prompt share its blocks (``kvstore serve`` does the same).
* ``store(tokens, cache, evict_prefixes)``: the cache covers a prefix of
  ``tokens`` (a finished request's prompt and answer, or a prompt alone); the
  store keeps the blocks it lacks. Its arrays are captured on the calling
  thread in microseconds; converting and queueing run on a thread of ours.
* ``remove`` / ``evict_prefixes``: blocks are shared by every prompt that
  starts with them, so nothing is removed for one key (the store evicts
  least recently used leaves under its budgets).
* ``clear()``: resets this engine's counters and leaves the store alone (the
  scheduler clears on an engine reset, on close and after an engine error,
  none of which says anything about stored KV, and other engines and processes
  may share the store; ``kvstore clear PATH`` empties a store).
* vllm-mlx's own SSD tier and save/load are not used: the store writes
  through to its own LMDB file as it goes (``save_to_disk`` flushes it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from kvstore import PrefixStore
from kvstore.errors import ConfigError

from .generate import calibrate_once, named_key, needs_snapshots, prefill
from .inserts import Inserts
from .mlx_lm import cache_offset, layers_to_cache, snapshot
from .request_log import log_request
from . import vllm_usage

__all__ = ["StorePrefixCache", "StoreTrieCache"]

log = logging.getLogger("kvstore")

_MB = 1024 * 1024


class _Count:
    """``len()`` of what the scheduler reads as ``_entries`` (it only logs it)."""

    def __init__(self, store: PrefixStore):
        self._store = store

    def __len__(self) -> int:
        return self._store.sequences


@dataclass
class _Stats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    store_rejections: int = 0


class StorePrefixCache:
    """vllm-mlx's ``MemoryAwarePrefixCache`` interface over a ``PrefixStore``.

    ``model`` is the engine's model (its cache classes are rebuilt from it and
    its files, or its fingerprint, key the store: see ``model_key``); ``model_path`` its
    local folder, when known (else the folder mlx-lm's load recorded, if any).
    ``max_kv_size`` must be the scheduler's ``--max-kv-size`` (restored caches
    are built with the same bound, or the scheduler rejects them).
    """

    # read by the scheduler after each fetch
    _last_match_type: Optional[str] = None
    _last_matched_key: Optional[tuple[int, ...]] = None

    def __init__(self, store: PrefixStore, model: nn.Module, *, model_path: Union[str, Path, None] = None,
                 max_kv_size: Optional[int] = None, calibrate_prefill: bool = True):
        self.prefix_store = store
        self.model = model
        self.max_kv_size = max_kv_size or None
        folder = Path(model_path).expanduser() if model_path is not None else None
        self.key = named_key(store, model, folder if folder is not None and folder.exists() else None)
        self._inserts = Inserts(store)
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._hit = vllm_usage.HitRecord()
        if calibrate_prefill:
            calibrate_once(store, self.key, [model])  # the scheduler's prefills cannot be timed from here

    # -- what the scheduler calls ---------------------------------------------

    def fetch(self, tokens: list[int]) -> tuple[Optional[list], list[int]]:
        """The longest stored prefix of ``tokens`` short of the last token."""
        self._last_matched_key = None
        self._hit.tokens = 0
        tokens = list(tokens)
        cache = None
        if len(tokens) >= 2:
            self.settle()  # a follow-up sent as its predecessor ends still finds it
            try:
                hit = self.prefix_store.fetch(self.key, tokens, limit=len(tokens) - 1)
                log_request(len(tokens), hit)
                if hit:
                    cache = layers_to_cache(hit.layers, self.model, length=hit.length,
                                            max_kv_size=self.max_kv_size)
            except Exception:
                log.exception("kvstore: restoring a cache failed; computing the prompt instead")
                cache = None
        n = hit.length if cache is not None else 0
        try:
            cache, stop = self._snapshot_blocks(tokens, cache, n)
        except Exception:
            log.exception("kvstore: computing a prompt's blocks failed; the engine computes the prompt instead")
            cache, stop = None, 0
        with self._lock:
            self._stats.hits += bool(n)
            self._stats.misses += not n
            self._stats.tokens_saved += n
        if cache is None:
            self._last_match_type = "miss"
            return None, tokens
        self._hit.tokens = n
        self._last_match_type = "prefix"  # never "exact": the scheduler would drop it
        self._last_matched_key = tuple(tokens[:stop])
        if n:
            log.info("kvstore: %d of %d prompt tokens from the store (RAM %d, SSD %d, remote %d)", n, len(tokens),
                     hit.ram_tokens, hit.ssd_tokens, hit.remote_tokens)
        return cache, tokens[stop:]

    def _snapshot_blocks(self, tokens: list[int], cache: Optional[list], start: int) -> tuple[Optional[list], int]:
        """For a model whose cache cannot be cut back (recurrent state,
        sliding windows): compute the prompt's whole blocks past ``start``
        here, offering the cache to the store at each block boundary (as
        ``kvstore serve`` does), so a later prompt that shares only a system
        prompt finds a snapshot; the scheduler goes on from the last
        boundary. ``(cache, start)`` as given for attention-only models."""
        bs = self.prefix_store.block_size
        stop = (len(tokens) - 1) // bs * bs  # the engine computes at least the last token
        if stop <= start or min(tokens) < 0:
            return cache, start
        work = cache if cache is not None else make_prompt_cache(self.model, max_kv_size=self.max_kv_size)
        if not needs_snapshots(work):
            return cache, start
        prefill(self.model, work, tokens, start, stop, store=self.prefix_store, key=self.key, step=bs)
        return work, stop

    def store(self, tokens: list[int], cache: list[Any], evict_prefixes: bool = True) -> bool:
        """Keep the blocks of ``tokens`` that ``cache`` covers and the store
        lacks. Returns once the cache's arrays are captured."""
        try:
            n = cache_offset(cache)
            if n == 0 or n > len(tokens):
                raise ValueError(f"the cache covers {n} tokens of a {len(tokens)}-token key")
            frozen, arrays = snapshot(cache)
            mx.async_eval(arrays)  # on the engine's stream; the insert thread waits for them
        except Exception as e:
            return self.reject(e)
        self._inserts.submit(self.key, list(tokens[:n]), [frozen], arrays)
        return True

    def reject(self, why: Exception) -> bool:
        """Count and log a cache that could not be stored; False."""
        with self._lock:
            self._stats.store_rejections += 1
        log.warning("kvstore: a cache was not stored: %s", why)
        return False

    def remove(self, tokens: list[int], *, include_ssd: bool = False) -> bool:
        """Nothing is removed for one key: its blocks are shared with every
        prompt that starts with them."""
        return False

    def clear(self) -> None:
        """Reset this engine's counters; what is stored stays. The scheduler
        clears on an engine reset, on closing and after an engine error, none
        of which says anything about stored KV, and the store may serve other
        engines and processes: ``kvstore clear PATH`` (or ``PrefixStore.clear``)
        empties it."""
        self.settle()
        self.reset_stats()

    def get_stats(self) -> dict[str, Any]:
        """The built-in cache's counters (same keys, this process's requests),
        and the store's own under ``kvstore``."""
        s = self._stats
        looked = s.hits + s.misses
        stats = self.prefix_store.stats()
        return {
            "hits": s.hits,
            "misses": s.misses,
            "hit_rate": round(s.hits / looked, 4) if looked else 0.0,
            "evictions": stats.get("evictions_ram", 0),
            "tokens_saved": s.tokens_saved,
            "current_memory_mb": round(self.prefix_store.nbytes / _MB, 2),
            "max_memory_mb": round(self.memory_limit_mb, 2),
            "memory_utilization": round(self.prefix_store.nbytes / max(1, stats["ram_budget"]), 4),
            "entry_count": self.prefix_store.sequences,
            "store_rejections": s.store_rejections,
            "kvstore": stats,
        }

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = _Stats()

    @property
    def _entries(self) -> _Count:
        return _Count(self.prefix_store)

    @property
    def _current_memory(self) -> int:
        return self.prefix_store.nbytes

    @property
    def memory_usage_mb(self) -> float:
        return self.prefix_store.nbytes / _MB

    @property
    def memory_limit_mb(self) -> float:
        return self.prefix_store.stats()["ram_budget"] / _MB

    def __len__(self) -> int:
        return self.prefix_store.sequences

    def save_to_disk(self, cache_dir: str) -> bool:
        """Everything stored so far is written to the store's own SSD tier
        (``cache_dir`` is not used: the store writes through as it goes)."""
        self.flush()
        return self.prefix_store.stats().get("ssd_path") is not None

    def load_from_disk(self, cache_dir: str) -> int:
        """The store's entries are found on disk as requests need them."""
        return self.prefix_store.sequences

    def set_ssd_tier(self, ssd_tier: Any) -> None:
        if ssd_tier is not None:
            raise ConfigError("vllm-mlx's SSD cache tier (--ssd-cache-dir) does not apply under kvstore: the store "
                              "has its own (PrefixStore(ssd_path=...), kvstore vllm-mlx serve --ssd-path DIR)")

    def check_ssd(self, tokens: list[int]) -> None:
        return None  # no second SSD tier: fetch already looked on disk

    def try_reserve_memory(self, nbytes: int) -> bool:
        return False  # only vllm-mlx's SSD tier promotes through reservations

    def release_reserved_memory(self, nbytes: int) -> None:
        return None

    # -- ours -------------------------------------------------------------------

    def last_hit(self) -> int:
        """Prompt tokens the store served to this thread's last fetch."""
        return self._hit.tokens

    def settle(self) -> None:
        """Wait until the stores so far are in the store's index (not yet written)."""
        self._inserts.wait(self.key)

    def flush(self) -> None:
        """Wait until every store so far is in the store, encoded and written."""
        self._inserts.wait()
        self.prefix_store.flush()

    def close(self) -> None:
        """Finish the stores in flight (the store stays open)."""
        self._inserts.close()


class StoreTrieCache:
    """mlx-lm's ``LRUPromptCache`` interface, as vllm-mlx's ``SimpleEngine``
    uses it (``--prefix-trie-cache``), over a ``PrefixStore``: one
    ``StorePrefixCache`` per model it is asked about."""

    def __init__(self, store: PrefixStore, *, model_path: Union[str, Path, None] = None,
                 max_kv_size: Optional[int] = None, calibrate_prefill: bool = True):
        self.prefix_store = store
        self._args = dict(model_path=model_path, max_kv_size=max_kv_size, calibrate_prefill=calibrate_prefill)
        self._caches: dict[int, StorePrefixCache] = {}

    @property
    def _trie(self) -> "StoreTrieCache":
        return self  # SimpleEngine peeks here (``_trie.search``) before it fetches

    def search(self, model: nn.Module, tokens: list[int]) -> Any:
        """What a fetch would serve, as mlx-lm's trie search reports it: a
        shorter stored prefix (short of the last token), nothing exact or longer."""
        from types import SimpleNamespace

        cache = self.cache_for(model)
        cache.settle()  # as fetch: a request's insert is visible to the next one's peek
        n = cache.prefix_store.contains(cache.key, list(tokens)[:-1]) if len(tokens) >= 2 else 0
        return SimpleNamespace(model=model, exact=None, shorter=list(tokens[:n]) if n else None, longer=None,
                               common_prefix=0)

    def cache_for(self, model: nn.Module) -> StorePrefixCache:
        if id(model) not in self._caches:
            self._caches[id(model)] = StorePrefixCache(self.prefix_store, model, **self._args)
        return self._caches[id(model)]

    def fetch_nearest_cache(self, model: nn.Module, tokens: list[int]) -> tuple[Optional[list], list[int]]:
        return self.cache_for(model).fetch(tokens)

    def insert_cache(self, model: nn.Module, tokens: list[int], prompt_cache: list, **_: Any) -> None:
        self.cache_for(model).store(tokens, prompt_cache)

    @property
    def nbytes(self) -> int:
        return self.prefix_store.nbytes

    def __len__(self) -> int:
        for c in self._caches.values():  # SimpleEngine skips an empty trie: count the inserts in flight too
            c.settle()
        return self.prefix_store.sequences

    def flush(self) -> None:
        for c in self._caches.values():
            c.flush()

    def close(self) -> None:
        for c in self._caches.values():
            c.close()
