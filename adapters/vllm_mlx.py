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

Every reliance on vllm-mlx's internals lives in this module and is checked by
``check_vllm_mlx`` before anything is replaced: a version without what it
relies on gets one ``VllmMlxUnsupported`` naming the version, never a silent
fall-back to the built-in cache.

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

import argparse
import inspect
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from kvstore import PrefixStore
from kvstore.config import store_config
from kvstore.errors import ConfigError, KVStoreError

from .generate import calibrate_once, model_key, needs_snapshots, prefill
from .internals import Handle, scheduler_module, signature_mismatch, unsupported
from .inserts import Inserts
from .mlx_lm import cache_offset, layers_to_cache, snapshot
from . import vllm_usage

__all__ = ["StorePrefixCache", "StoreTrieCache", "install", "attach", "check_vllm_mlx", "VllmMlxUnsupported", "TESTED"]

log = logging.getLogger("kvstore")

_MB = 1024 * 1024
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
    its fingerprint keys the store: see ``model_key``); ``model_path`` its
    local folder, when known, for a faster and stabler fingerprint.
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
        self.key = model_key(model, folder if folder is not None and folder.exists() else None)
        if folder is not None and (folder / "config.json").is_file():
            store.register_model(self.key, {"path": str(folder.resolve()), "name": folder.name})
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


# ---------------------------------------------------------------------------
# kvstore vllm-mlx serve
# ---------------------------------------------------------------------------

# vllm-mlx serve options that would take the prefix cache away from the store
# or set a second one beside it, with what to use instead
_REFUSED = {
    "--ssd-cache-dir": "the store has its own SSD tier: --ssd-path DIR",
    "--ssd-cache-max-gb": "the store's SSD tier is bounded by --disk-budget-gb",
    "--use-paged-cache": "the store replaces the memory-aware prefix cache; the paged cache would bypass it",
    "--no-memory-aware-cache": "the store replaces the memory-aware prefix cache",
    "--disable-prefix-cache": "serve with vllm-mlx serve directly to run without a prefix cache",
    "--cache-memory-mb": "the store's RAM budget is --budget-gb",
    "--cache-memory-percent": "the store's RAM budget is --budget-gb",
    "--kv-cache-quantization": "stored entries are quantized with --kv-bits B (8, 4, or K,V like 8,4)",
    "--kv-cache-quantization-bits": "stored entries are quantized with --kv-bits B",
    "--kv-cache-quantization-group-size": "the store's group size is --store-group-size",
    "--prefix-trie-cache-size": "the store is bounded by bytes: --budget-gb (RAM) and --disk-budget-gb (SSD)",
    "--prefix-trie-cache-memory-mb": "the store's RAM budget is --budget-gb",
}


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore vllm-mlx serve", add_help=False, allow_abbrev=False)
    p.add_argument("--ssd-path", default=None)
    p.add_argument("--budget-gb", type=float, default=4.0)
    p.add_argument("--disk-budget-gb", type=float, default=None)
    p.add_argument("--kv-bits", default=None)
    p.add_argument("--store-group-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None)  # None: the store's own (256 for a new one)
    p.add_argument("--namespace", default=None)
    p.add_argument("--fetch-policy", default="auto", choices=["auto", "always", "never"])
    p.add_argument("--calibrate-budget-s", type=float, default=3.0)  # 0: no calibration of the model's prefill
    p.add_argument("--ssd-admit", default="always", choices=["always", "reuse"])
    p.add_argument("--remote", default=None)
    p.add_argument("--remote-timeout", type=float, default=0.5)
    p.add_argument("--remote-secret", default=None)  # better: $KVSTORE_REMOTE_SECRET (not in process lists)
    return p


def parse_serve_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """``kvstore vllm-mlx serve``'s own options as ``PrefixStore`` arguments,
    and the rest for ``vllm-mlx serve``: continuous batching added, unless
    ``--prefix-trie-cache`` asks for vllm-mlx's SimpleEngine. Options
    that would move the prefix cache off the store exit with code 2, naming
    what to use instead."""
    from .server import parse_kv_bits

    parser = _serve_parser()
    opts, rest = parser.parse_known_args(list(argv))
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name in _REFUSED:
            parser.error(f"{name} does not apply on the store: {_REFUSED[name]}")
    try:
        bits = parse_kv_bits(opts.kv_bits)
    except ValueError as e:
        parser.error(f"--kv-bits: {e}")
    store_args = dict(budget_gb=opts.budget_gb, ssd_path=opts.ssd_path, block_size=opts.block_size, kv_bits=bits,
                      kv_group_size=opts.store_group_size, namespace=opts.namespace,
                      disk_budget_gb=opts.disk_budget_gb, fetch_policy=opts.fetch_policy, remote=opts.remote,
                      remote_timeout=opts.remote_timeout, remote_secret=opts.remote_secret,
                      calibrate_budget_s=opts.calibrate_budget_s, ssd_admit=opts.ssd_admit)
    if "--continuous-batching" not in rest and "--prefix-trie-cache" not in rest:
        rest.append("--continuous-batching")
    return store_args, rest


def _report_cached_tokens() -> None:
    """vllm-mlx's app reports the store's hits in usage (``vllm_usage``)."""
    import vllm_mlx.server as vserver

    app = getattr(vserver, "app", None)
    if not callable(getattr(app, "add_middleware", None)):
        raise unsupported(VllmMlxUnsupported, "vllm-mlx", "vllm-mlx", TESTED)("no vllm_mlx.server.app to add middleware to")
    app.add_middleware(vllm_usage.UsageMiddleware)


def serve(argv: Sequence[str]) -> None:
    """``kvstore vllm-mlx serve MODEL [store options] [vllm-mlx serve options]``:
    vllm-mlx's own server, continuous batching, on a ``PrefixStore``. SIGTERM
    or Ctrl-C shuts the server down, then flushes and closes the store."""
    import signal
    import sys

    store_args, rest = parse_serve_args(argv)
    config = store_config(**store_args)  # a bad store option is an error now
    check_vllm_mlx()  # before anything starts: an unsupported version exits here
    import vllm_mlx.cli as vcli

    vargs = vcli.create_parser().parse_args(["serve", *rest])  # vllm-mlx's own reading of its options
    _report_cached_tokens()
    store = PrefixStore(config)
    installed = install(store, model_path=vargs.model, max_kv_size=vargs.max_kv_size or None)
    from .vllm_metrics import add_store_metrics

    remove_metrics = add_store_metrics(store)  # kvstore_* series in /metrics (with --enable-metrics)

    def stop(signum, frame):
        # uvicorn shuts down on SIGTERM, then raises it again for the handler it found: ours ends main()
        raise KeyboardInterrupt

    argv0, previous = sys.argv, signal.signal(signal.SIGTERM, stop)
    sys.argv = ["vllm-mlx", "serve", *rest]
    try:
        vcli.main()  # returns (or raises KeyboardInterrupt) once uvicorn has shut down
    except KeyboardInterrupt:
        pass
    finally:
        sys.argv = argv0
        signal.signal(signal.SIGTERM, previous)
        remove_metrics()
        installed.close()
        store.close()
        log.info("kvstore: store closed, pending blocks written")
