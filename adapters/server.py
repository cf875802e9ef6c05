"""mlx-lm's server on the store.

``StorePromptCache`` has the interface ``mlx_lm.server`` expects of its
``LRUPromptCache`` (``fetch_nearest_cache``, ``insert_cache``, ``trim_to``,
``nbytes``, ``__len__``, ``stats_by_type``), so the server, continuous batching
included, runs unchanged on a ``PrefixStore``: caches survive restarts, are
kept quantized and spill to SSD. ``serve`` starts mlx-lm's own server with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional, Sequence


from kvstore import PrefixStore

from .generate import model_key
from .mlx_lm import cache_offset, cache_to_layers, layers_to_cache

log = logging.getLogger("kvstore")

_TYPES = ("assistant", "user", "system")


class StorePromptCache:
    """``LRUPromptCache``'s interface over a ``PrefixStore``.

    ``model_provider`` is mlx-lm's ``ModelProvider``: the store needs the
    loaded model to rebuild its cache classes and to fingerprint it (the
    server's own key is a path or a hub name, which says nothing of the
    weights behind it).
    """

    def __init__(self, store: PrefixStore, model_provider: Any):
        self.store = store
        self.provider = model_provider
        self._keys: dict[Any, str] = {}
        self._by_type = {t: {"n_sequences": 0, "n_bytes": 0} for t in _TYPES}

    # -- the server's interface ---------------------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Optional[list], list[int]]:
        key = self._key(model)
        if key is None or len(tokens) < 2:
            return None, tokens
        args = self.provider.cli_args
        kv_bits = getattr(args, "kv_bits", None)
        group = getattr(args, "kv_group_size", 64)
        try:
            hit = self.store.fetch(key, tokens, limit=len(tokens) - 1,
                                   quantized=(kv_bits, group) if kv_bits else None)
            if not hit:
                return None, tokens
            cache = layers_to_cache(hit.layers, self.provider.model, length=hit.length, kv_bits=kv_bits,
                                    kv_group_size=group,
                                    quantized_kv_start=getattr(args, "quantized_kv_start", 0))
        except Exception:
            log.exception("kvstore: restoring a cache failed; computing the prompt instead")
            return None, tokens
        return cache, tokens[hit.length:]

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list, *, cache_type: str = "assistant"):
        key = self._key(model)
        if key is None:
            return
        try:
            n = cache_offset(prompt_cache)
            new = self.store.put(key, list(tokens[:n]), cache_to_layers(prompt_cache)) if n else 0
        except Exception:
            log.exception("kvstore: storing a cache failed; it is skipped")
            return
        slot = self._by_type.setdefault(cache_type, {"n_sequences": 0, "n_bytes": 0})
        slot["n_sequences"] += 1 if new else 0

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """The server asks to stay under ``n_bytes`` while requests hold
        caches: evict RAM blocks down to it (SSD copies stay)."""
        if n_bytes is not None:
            self.store.trim_ram(max(0, n_bytes))

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def __len__(self) -> int:
        return len(self.store)

    def stats_by_type(self) -> dict:
        out = {t: dict(v) for t, v in self._by_type.items()}
        out.setdefault("assistant", {})["n_bytes"] = self.store.nbytes
        return out

    # -- helpers --------------------------------------------------------------

    def _key(self, model: Any) -> Optional[str]:
        """Store key of the server's current model; ``None`` disables the
        store (a draft model's cache would not line up with a restored one)."""
        if model in self._keys:
            return self._keys[model]
        provider = self.provider
        path, adapter, draft = (tuple(model) + (None, None, None))[:3] if isinstance(model, tuple) else (model, None, None)
        if draft is not None or provider.model is None:
            self._keys[model] = None
            return None
        local = Path(str(path)).expanduser()
        key = model_key(provider.model, local if (local / "config.json").is_file() else None,
                        extra=f"adapter={adapter}" if adapter else "")
        if (local / "config.json").is_file():
            self.store.register_model(key, {"path": str(local.resolve()), "name": local.name})
        self._keys[model] = key
        return key


def serve(argv: Optional[Sequence[str]] = None) -> None:
    """``kvstore serve``: mlx-lm's server (all its options) on a PrefixStore."""
    import mlx_lm.server as S

    ours = argparse.ArgumentParser(prog="kvstore serve", add_help=False)
    ours.add_argument("--ssd-path", default=None)
    ours.add_argument("--budget-gb", type=float, default=4.0)
    ours.add_argument("--disk-budget-gb", type=float, default=None)
    ours.add_argument("--store-kv-bits", default=None,
                      help="bits of stored entries: 8, 4, or K,V like 8,4 (default: as the engine holds them)")
    ours.add_argument("--store-group-size", type=int, default=64)
    ours.add_argument("--block-size", type=int, default=256)
    ours.add_argument("--namespace", default=None)
    opts, rest = ours.parse_known_args(argv)
    bits = None
    if opts.store_kv_bits:
        parts = [int(x) for x in opts.store_kv_bits.split(",")]
        bits = parts[0] if len(parts) == 1 else tuple(parts)
    store = PrefixStore(budget_gb=opts.budget_gb, ssd_path=opts.ssd_path, block_size=opts.block_size,
                        kv_bits=bits, kv_group_size=opts.store_group_size, namespace=opts.namespace,
                        disk_budget_gb=opts.disk_budget_gb)

    def run(host, port, model_provider, server_class=S.ThreadingHTTPServer, handler_class=S.APIHandler):
        generator = S.ResponseGenerator(model_provider, StorePromptCache(store, model_provider))
        S._run_http_server(host, port, generator, server_class, handler_class)

    def stop(signum, frame):  # SIGTERM skips atexit by default: turn it into a clean shutdown
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    S.run = run
    argv0 = sys.argv
    sys.argv = ["mlx_lm.server", *rest]
    try:
        S.main()
    except KeyboardInterrupt:
        pass
    finally:
        sys.argv = argv0
        store.close()
        log.info("kvstore: store closed, pending blocks written")
    # mlx-lm's generation thread cannot be joined at interpreter exit (its C++
    # side aborts); everything of ours is on disk now, so leave at once.
    logging.shutdown()
    os._exit(0)
