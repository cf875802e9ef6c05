"""oMLX on the store.

oMLX (``flyto-mlx`` on PyPI, the package ``omlx``) keeps prompts' KV in a
``BlockAwarePrefixCache`` (prefix matching over ``PagedCacheManager`` blocks)
whose blocks go to its ``PagedSSDCacheManager``. Its ``Scheduler`` builds
that cache by the module-level name ``omlx.scheduler.BlockAwarePrefixCache``
when ``SchedulerConfig.paged_ssd_cache_dir`` is set; ``install`` puts
``StoreBlockCache`` in the name's place, so every scheduler built while it is
installed (``EngineCore``, ``AsyncEngineCore``, the engine pool, the server)
keeps its prompts' KV in the store: quantized, in RAM, LMDB on SSD and Redis,
across restarts and processes. ``attach`` swaps it into a scheduler already
built.

``StoreBlockCache`` answers the calls the scheduler makes (``fetch_cache``,
``reconstruct_cache``, ``store_cache``, ``clear_request_entry``, the stats)
through the vllm-mlx adapter's ``StorePrefixCache``, which does the store's
side. oMLX's own ``PagedSSDCacheManager`` is still built in
``paged_ssd_cache_dir`` (the scheduler needs the directory to build a prefix
cache at all) but receives no blocks: only ``BlockAwarePrefixCache`` writes
to it. Requests with image keys (VLM ``extra_keys``) are neither served nor
stored: the store keys KV by tokens alone and never serves KV that belongs to
another image. The draft model of speculative decoding keeps oMLX's own cache
(the scheduler imports that one under another name).

Every reliance on oMLX's internals lives in this module and is checked by
``check_omlx`` before anything is replaced; a version without it gets one
``OmlxUnsupported`` naming the version, never a fall-back to oMLX's cache.
"""

from __future__ import annotations

import inspect
import re
import threading
from pathlib import Path
from typing import Any, Optional, Union

import mlx_lm.models.cache as mlx_cache

from kvstore import PrefixStore
from kvstore.errors import ConfigError, KVStoreError

from .internals import Handle, scheduler_module, signature_mismatch, unsupported
from .vllm_mlx_cache import StorePrefixCache

__all__ = ["StoreBlockCache", "install", "attach", "check_omlx", "OmlxUnsupported", "TESTED"]


TESTED = ("0.7.0",)  # flyto-mlx (oMLX) versions CI runs the adapter's tests on


class OmlxUnsupported(KVStoreError):
    """The installed oMLX lacks something the adapter relies on."""



# the built-in cache's methods whose arguments the scheduler passes positionally
_SIGNATURES = {
    "fetch_cache": ("self", "request_id", "tokens"),
    "store_cache": ("self", "request_id", "tokens", "cache_data", "model_cache_config", "boundary_snapshots"),
    "reconstruct_cache": ("self", "block_table"),
    "clear_request_entry": ("self", "request_id"),
}


def check_omlx() -> Any:
    """oMLX's scheduler module, once it is known to have what the adapter
    relies on; ``OmlxUnsupported`` (naming the version and the missing part)
    otherwise."""
    fail = unsupported(OmlxUnsupported, "oMLX (flyto-mlx)", "flyto-mlx", TESTED, "--no-deps ")

    S, source = scheduler_module("omlx.scheduler", "BlockAwarePrefixCache", fail)
    try:
        from omlx.cache.paged_cache import BlockTable
        from omlx.cache.stats import PrefixCacheStats
    except ImportError as e:
        raise fail(f"omlx.cache does not import: {e}") from e
    try:
        init = inspect.getsource(S.Scheduler.__init__)
        extract = inspect.getsource(S.Scheduler._extract_cache_states)
    except (OSError, TypeError, AttributeError) as e:
        raise fail(f"the Scheduler's source cannot be read: {e}") from e
    if "BlockAwarePrefixCache(" not in init or "paged_ssd_cache_dir" not in init:
        raise fail("Scheduler.__init__ no longer builds BlockAwarePrefixCache by name when paged_ssd_cache_dir is set")
    if '"class_name"' not in extract or '"state"' not in extract:
        raise fail("Scheduler._extract_cache_states no longer hands the cache over as state/class_name dicts")
    if "reconstruct_cache(block_table)" not in source or "block_table.num_tokens" not in source:
        raise fail("the scheduler no longer restores a hit through reconstruct_cache(block_table)")
    missing = sorted(n for n in set(re.findall(r"block_aware_cache\.(\w+)", source))
                     if not hasattr(StoreBlockCache, n))
    if missing:
        raise fail(f"its scheduler calls {', '.join(missing)} on the prefix cache, which the adapter does not provide")
    builtin = getattr(S.BlockAwarePrefixCache, "kvstore_replaces", S.BlockAwarePrefixCache)  # installed already?
    mismatch = signature_mismatch(builtin, _SIGNATURES)
    if mismatch:
        raise fail(mismatch)
    fields = set(getattr(PrefixCacheStats, "__dataclass_fields__", {}))
    if not {"hits", "misses", "tokens_saved", "tokens_matched_total", "tokens_requested_total"} <= fields:
        raise fail("PrefixCacheStats lacks the counters the scheduler reads")
    if not {"request_id", "block_ids", "num_tokens"} <= set(getattr(BlockTable, "__dataclass_fields__", {})):
        raise fail("BlockTable is no longer (request_id, block_ids, num_tokens)")
    return S


def _as_caches(cache_data: list[Any]) -> list[Any]:
    """mlx-lm cache objects from what the scheduler stores: extracted
    ``{"state", "meta_state", "class_name"}`` dicts (or cache objects)."""
    out = []
    for i, layer in enumerate(cache_data):
        if not isinstance(layer, dict):
            out.append(layer)
            continue
        cls = getattr(mlx_cache, layer.get("class_name", ""), None)
        if cls is None or not hasattr(cls, "from_state") or not layer.get("state"):
            raise ValueError(f"layer {i} is a {layer.get('class_name')!r} the store cannot rebuild")
        out.append(cls.from_state(layer["state"], layer.get("meta_state", "")))
    return out


class StoreBlockCache:
    """oMLX's ``BlockAwarePrefixCache`` interface over a ``PrefixStore``.

    A hit comes back as a ``BlockTable`` with no block ids (no oMLX block
    holds it) that is true while it covers tokens, so the scheduler's own
    release calls on its ``PagedCacheManager`` find nothing to release.
    """

    def __init__(self, store: PrefixStore, model: Any, *, model_path: Union[str, Path, None] = None,
                 calibrate_prefill: bool = True):
        from omlx.cache.paged_cache import BlockTable

        class _Hit(BlockTable):
            def __bool__(self) -> bool:
                return self.num_tokens > 0

        self._Hit = _Hit
        self.cache = StorePrefixCache(store, model, model_path=model_path, calibrate_prefill=calibrate_prefill)
        self.prefix_store = store
        self._restored: dict[str, list] = {}
        self._lock = threading.Lock()
        self._requested = 0
        self._matched = 0

    def fetch_cache(self, request_id: str, tokens: list[int], extra_keys: Any = None,
                    extra_key_token_start: Optional[int] = None, extra_key_ranges: Any = None) -> tuple[Any, list[int]]:
        """The longest stored prefix of ``tokens`` short of the last token."""
        tokens = list(tokens)
        if extra_keys or extra_key_ranges:  # image-keyed prompts: tokens alone do not identify their KV
            return None, tokens
        cache, remaining = self.cache.fetch(tokens)
        n = len(tokens) - len(remaining)
        with self._lock:
            self._requested += len(tokens)
            self._matched += n
            if cache is None:
                return None, tokens
            self._restored[request_id] = cache
        return self._Hit(request_id=request_id, num_tokens=n), remaining

    def reconstruct_cache(self, block_table: Any) -> Optional[list]:
        """The caches ``fetch_cache`` restored for this request (once)."""
        with self._lock:
            return self._restored.pop(block_table.request_id, None)

    def store_cache(self, request_id: str, tokens: list[int], cache_data: list[Any], model_cache_config: Any = None,
                    boundary_snapshots: Any = None, extra_keys: Any = None, extra_key_token_start: Optional[int] = None,
                    extra_key_ranges: Any = None) -> None:
        """Keep the blocks of ``tokens`` that ``cache_data`` covers and the
        store lacks (oMLX calls this on its store worker thread)."""
        if extra_keys or extra_key_ranges:
            return None
        try:
            caches = _as_caches(cache_data)
        except Exception as e:
            self.cache.reject(e)
            return None
        self.cache.store(list(tokens), caches)
        return None

    def clear_request_entry(self, request_id: str) -> None:
        with self._lock:
            self._restored.pop(request_id, None)

    def clear(self) -> int:
        """Reset this engine's counters; what is stored stays (oMLX clears on
        an engine reset and on close; ``kvstore clear PATH`` empties a store)."""
        self.cache.clear()
        with self._lock:
            self._restored.clear()
            self._requested = self._matched = 0
        return 0

    def set_paged_ssd_cache_manager(self, manager: Any) -> None:
        """oMLX's SSD tier is not used: the store has its own."""

    def set_cold_restore_callback(self, callback: Any) -> None:
        """No oMLX blocks to restore: the store fetches from its own tiers."""

    def get_stats(self) -> Any:
        from omlx.cache.stats import PrefixCacheStats

        s = self.cache._stats
        return PrefixCacheStats(hits=s.hits, misses=s.misses, tokens_saved=s.tokens_saved,
                                tokens_matched_total=self._matched, tokens_requested_total=self._requested)

    def get_stats_dict(self) -> dict[str, Any]:
        return {**self.cache.get_stats(), "tokens_matched_total": self._matched,
                "tokens_requested_total": self._requested}

    def reset_stats(self) -> None:
        self.clear()

    def __len__(self) -> int:
        return self.prefix_store.sequences

    def flush(self) -> None:
        """Wait until every store so far is in the store, encoded and written."""
        self.cache.flush()

    def close(self) -> None:
        self.cache.close()


class Installed(Handle):
    """``install``'s handle: ``uninstall()`` (or leaving its ``with``) puts
    oMLX's own cache back for schedulers built afterwards."""

    def __init__(self, module: Any):
        super().__init__()
        self._module = module
        self._original = module.BlockAwarePrefixCache

    def uninstall(self) -> None:
        self._module.BlockAwarePrefixCache = self._original


def install(store: PrefixStore, *, model_path: Union[str, Path, None] = None,
            calibrate_prefill: bool = True) -> Installed:
    """Every oMLX ``Scheduler`` built from now on (until ``uninstall``) with a
    ``paged_ssd_cache_dir`` keeps its prefix cache in ``store``."""
    S = check_omlx()
    installed = Installed(S)

    def build(model: Any, paged_cache_manager: Any = None, **_: Any) -> StoreBlockCache:
        cache = StoreBlockCache(store, model, model_path=model_path, calibrate_prefill=calibrate_prefill)
        installed.caches.append(cache)
        return cache

    build.kvstore_replaces = getattr(S.BlockAwarePrefixCache, "kvstore_replaces", S.BlockAwarePrefixCache)
    S.BlockAwarePrefixCache = build
    return installed


def attach(engine: Any, store: PrefixStore, *, model_path: Union[str, Path, None] = None,
           calibrate_prefill: bool = True) -> StoreBlockCache:
    """Put ``store`` under an engine already built (an ``EngineCore`` or its
    ``Scheduler``). Raises ``ConfigError`` when it runs no prefix cache
    (oMLX builds one only with ``paged_ssd_cache_dir`` set)."""
    check_omlx()
    scheduler = getattr(engine, "scheduler", engine)
    if getattr(scheduler, "block_aware_cache", None) is None:
        raise ConfigError("the oMLX scheduler runs no prefix cache: build it with SchedulerConfig(paged_ssd_cache_dir="
                          "...) (oMLX's --paged-ssd-cache-dir); kvstore replaces that cache")
    cache = StoreBlockCache(store, scheduler.model, model_path=model_path, calibrate_prefill=calibrate_prefill)
    scheduler.block_aware_cache = cache
    return cache
