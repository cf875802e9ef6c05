"""vllm-mlx on the store.

vllm-mlx (an OpenAI/Anthropic-compatible MLX server with continuous batching)
has no plug-in point for a prefix cache: its ``Scheduler`` builds a
``MemoryAwarePrefixCache`` by that module-level name and calls a dozen
methods on it. ``StorePrefixCache`` has that interface over a ``PrefixStore``,
and ``install`` puts it in the name's place, so every scheduler built while it
is installed (``EngineCore``, ``AsyncEngineCore``, ``BatchedEngine``, the
server) keeps its prompts' KV in the store: quantized, on SSD, across restarts
and processes. ``attach`` swaps it into an engine already built. The
``SimpleEngine`` path (one request at a time, ``--prefix-trie-cache``: mlx-lm's
``LRUPromptCache`` there) gets ``StoreTrieCache`` in that cache's place.

Every reliance on vllm-mlx's internals is checked by ``check_vllm_mlx``
(here) before anything is replaced: a version without what it
relies on gets one ``VllmMlxUnsupported`` naming the version, never a silent
fall-back to the built-in cache.

The caches' side (what the scheduler expects and how the store answers) is
:mod:`.vllm_mlx_cache`; ``kvstore vllm-mlx serve`` is :mod:`.vllm_mlx_serve`.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Optional, Union

from kvstore import PrefixStore
from kvstore.errors import ConfigError, KVStoreError

from .internals import Handle, scheduler_module, signature_mismatch, unsupported
from .vllm_mlx_cache import StorePrefixCache, StoreTrieCache
from . import vllm_usage

__all__ = ["StorePrefixCache", "StoreTrieCache", "install", "attach", "check_vllm_mlx", "VllmMlxUnsupported", "TESTED"]


TESTED = ("0.6.0",)  # vllm-mlx versions CI runs the adapter's tests on


class VllmMlxUnsupported(KVStoreError):
    """The installed vllm-mlx lacks something the adapter relies on."""


def _called_on_cache(source: str) -> set[str]:
    """Names the scheduler's code uses on its ``memory_aware_cache``."""
    direct = re.findall(r"memory_aware_cache\.(\w+)", source)
    by_getattr = re.findall(r"getattr\(\s*self\.memory_aware_cache,\s*\"(\w+)\"", source)
    return set(direct) | set(by_getattr)


def check_vllm_mlx() -> Any:
    """vllm-mlx's scheduler module, once it is known to have what the adapter
    relies on; ``VllmMlxUnsupported`` (naming the version and the missing part)
    otherwise."""
    fail = unsupported(VllmMlxUnsupported, "vllm-mlx", "vllm-mlx", TESTED)

    S, source = scheduler_module("vllm_mlx.scheduler", "MemoryAwarePrefixCache", fail)
    init = getattr(S.Scheduler.__init__, "kvstore_replaces", S.Scheduler.__init__)  # installed already?
    if "MemoryAwarePrefixCache(" not in inspect.getsource(init):
        raise fail("Scheduler.__init__ no longer builds MemoryAwarePrefixCache by name")
    if not isinstance(getattr(S.Scheduler, "SNAPSHOT_REFRESH_TOKENS", None), int):
        raise fail("Scheduler.SNAPSHOT_REFRESH_TOKENS is gone")
    try:
        from vllm_mlx.engine.simple import SimpleEngine
    except ImportError as e:
        raise fail(f"vllm_mlx.engine.simple does not import: {e}") from e
    if not callable(getattr(SimpleEngine, "_ensure_prefix_trie_cache", None)) \
            or "_prefix_trie_cache_enabled" not in inspect.getsource(SimpleEngine.__init__):
        raise fail("SimpleEngine no longer builds its prompt trie in _ensure_prefix_trie_cache")
    peek = getattr(SimpleEngine, "_peek_prefix_trie_tokens_saved", None)
    if peek is None or '"_trie"' not in inspect.getsource(peek) or '"shorter"' not in inspect.getsource(peek):
        raise fail("SimpleEngine no longer peeks at its prompt trie through _trie.search(...).shorter")
    for what in vllm_usage.missing(S, _engine_core()):
        raise fail(f"{what} (cached prompt tokens in usage rely on it)")
    missing = sorted(n for n in _called_on_cache(source) if not hasattr(StorePrefixCache, n))
    if missing:
        raise fail(f"its scheduler calls {', '.join(missing)} on the prefix cache, which the adapter does not provide")
    builtin = getattr(S.MemoryAwarePrefixCache, "kvstore_replaces", S.MemoryAwarePrefixCache)  # installed already?
    mismatch = signature_mismatch(builtin, _SIGNATURES)
    if mismatch:
        raise fail(mismatch)
    return S


def _engine_core() -> Any:
    from vllm_mlx.engine_core import EngineCore

    return EngineCore


# the built-in cache's methods whose arguments the scheduler passes positionally
_SIGNATURES = {
    "fetch": ("self", "tokens"),
    "store": ("self", "tokens", "cache", "evict_prefixes"),
    "remove": ("self", "tokens"),
}


class Installed(Handle):
    """``install``'s handle: ``uninstall()`` (or leaving its ``with``) puts
    vllm-mlx's own cache back for schedulers built afterwards; ``caches`` are
    the ``StorePrefixCache`` objects built meanwhile."""

    def __init__(self, module: Any, simple_engine: Any, undo_usage: Any):
        super().__init__()
        self._module = module
        self._undo_usage = undo_usage
        self._original = module.MemoryAwarePrefixCache
        self._init = module.Scheduler.__init__
        self._simple = simple_engine
        self._ensure_trie = simple_engine._ensure_prefix_trie_cache

    def uninstall(self) -> None:
        """Schedulers built from now on get vllm-mlx's own cache; those built
        while installed keep the store."""
        if self._module.MemoryAwarePrefixCache is not self._original:
            self._module.MemoryAwarePrefixCache = self._original
            self._module.Scheduler.__init__ = self._init
            self._simple._ensure_prefix_trie_cache = self._ensure_trie
            self._undo_usage()


def install(store: PrefixStore, *, model_path: Union[str, Path, None] = None, max_kv_size: Optional[int] = None,
            calibrate_prefill: bool = True) -> Installed:
    """Every vllm-mlx ``Scheduler`` built from now on (until ``uninstall``)
    keeps its prefix cache in ``store``, and so does every ``SimpleEngine``
    run with ``prefix_trie_cache=True`` (mlx-lm's ``LRUPromptCache`` there).
    The scheduler must use its memory-aware cache (vllm-mlx's default: not
    ``--use-paged-cache``, ``--no-memory-aware-cache`` or
    ``--disable-prefix-cache``).

    Each request notes how many prompt tokens the store served, which
    ``kvstore vllm-mlx serve`` reports in the API's usage (``vllm_usage``).

    Also lets non-trimmable caches (sliding windows that wrapped, recurrent
    state) be offered after every request rather than once per 4,096 new
    tokens: the store keeps only the blocks it lacks, so a refresh is cheap.
    """
    S = check_vllm_mlx()
    from vllm_mlx.engine.simple import SimpleEngine

    def hits(scheduler: Any) -> Optional[int]:
        cache = scheduler.memory_aware_cache
        return cache.last_hit() if isinstance(cache, StorePrefixCache) else None

    installed = Installed(S, SimpleEngine, vllm_usage.patch_engine(S, _engine_core(), hits))
    args = dict(model_path=model_path, max_kv_size=max_kv_size, calibrate_prefill=calibrate_prefill)

    def build(model: Any, config: Any = None) -> StorePrefixCache:
        cache = StorePrefixCache(store, model, **args)
        installed.caches.append(cache)
        return cache

    def trie(engine: Any) -> Optional[StoreTrieCache]:
        if not engine._prefix_trie_cache_enabled or engine._is_mllm:
            return None
        with engine._prefix_trie_cache_lock:
            if not isinstance(engine._prefix_trie_cache, StoreTrieCache):
                engine._prefix_trie_cache = StoreTrieCache(store, **args)
                installed.caches.append(engine._prefix_trie_cache)
        return engine._prefix_trie_cache

    init = S.Scheduler.__init__

    def scheduler_init(scheduler: Any, *a: Any, **kw: Any) -> None:
        init(scheduler, *a, **kw)
        if isinstance(scheduler.memory_aware_cache, StorePrefixCache):
            scheduler.SNAPSHOT_REFRESH_TOKENS = 0  # this scheduler's own, whatever is installed later

    scheduler_init.kvstore_replaces = getattr(init, "kvstore_replaces", init)
    build.kvstore_replaces = getattr(S.MemoryAwarePrefixCache, "kvstore_replaces", S.MemoryAwarePrefixCache)
    S.MemoryAwarePrefixCache = build
    S.Scheduler.__init__ = scheduler_init
    SimpleEngine._ensure_prefix_trie_cache = trie
    return installed


def attach(engine: Any, store: PrefixStore, *, model_path: Union[str, Path, None] = None,
           calibrate_prefill: bool = True) -> StorePrefixCache:
    """Put ``store`` under an engine already built: an ``EngineCore`` /
    ``AsyncEngineCore`` or its ``Scheduler`` (a ``BatchedEngine`` builds its
    core when started: ``install`` before, or attach to ``engine._engine``
    after). Raises ``ConfigError`` when the scheduler runs no memory-aware
    cache (paged cache, or prefix caching off)."""
    check_vllm_mlx()
    scheduler = getattr(engine, "scheduler", engine)
    if getattr(scheduler, "memory_aware_cache", None) is None:
        raise ConfigError("the scheduler runs no memory-aware prefix cache (paged cache or prefix caching off): "
                          "kvstore replaces that cache, so build the engine with vllm-mlx's default cache settings")
    bound = getattr(scheduler, "_bounded_kv_size", lambda: None)()
    cache = StorePrefixCache(store, scheduler.model, model_path=model_path, max_kv_size=bound,
                             calibrate_prefill=calibrate_prefill)
    scheduler.memory_aware_cache = cache
    scheduler.SNAPSHOT_REFRESH_TOKENS = 0  # as install: refreshes of non-trimmable caches are cheap here
    return cache
