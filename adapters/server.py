"""mlx-lm's server on the store.

``StorePromptCache`` (:mod:`.server_cache`) has the interface
``mlx_lm.server`` expects of its ``LRUPromptCache``, so the server, continuous
batching included, runs unchanged on a ``PrefixStore``: caches survive
restarts, are kept quantized and spill to SSD. ``start`` builds mlx-lm's own
server on a store, with mlx-lm's options and the store's
(:mod:`.server_args`); ``serve`` runs it (``kvstore serve``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from kvstore import PrefixStore
from kvstore.config import store_config

from .gguf import TRAINED, is_gguf, load_model
from .loading import ModelLoadError
from .metrics import with_metrics
from .server_args import parse_args
from .file_digests import settle
from .model_source import key_files
from .server_cache import StorePromptCache, folder_of

__all__ = ["StorePromptCache", "Server", "start", "serve", "parse_args"]

log = logging.getLogger("kvstore")


def _load_gguf_too(load):
    """mlx-lm's ``load``, which also takes a GGUF file or a trained model's
    name (``smollm2``, ``gemma3``) and reads it with ``load_gguf``."""
    if getattr(load, "reads_gguf", False):
        return load

    def load_any(path, *args, return_config: bool = False, **kwargs):
        adapter = kwargs.get("adapter_path", args[2] if len(args) > 2 else None)
        settle(key_files(folder_of(path), adapter and Path(adapter)))  # files written just now: keyed by content once they settle
        started = time.time_ns()
        if str(path) in TRAINED or is_gguf(Path(str(path)).expanduser()):
            model, tokenizer, _ = load_model(path)
            out = (model, tokenizer, {}) if return_config else (model, tokenizer)
        else:
            out = load(path, *args, return_config=return_config, **kwargs)
        if isinstance(out[0], nn.Module):  # files written since are not what it holds (_loaded_key)
            out[0]._kvstore_loaded_ns = started
            # evaluated here: the model loads on the main thread (load_default) and runs on the generation
            # thread, and mlx streams are per thread (an adapter's lazy weights failed there: "no Stream(cpu, 0)")
            mx.eval(out[0].parameters())
        return out

    load_any.reads_gguf = True
    return load_any


def _empty_without_hf_cache(scan):
    """huggingface_hub's ``scan_cache_dir``, which mlx-lm's ``GET /v1/models``
    calls, giving no repos where there is no Hugging Face cache (it raises
    ``CacheNotFound``: the request failed with a traceback in the log)."""
    if getattr(scan, "empty_without_cache", False):
        return scan
    from huggingface_hub.errors import CacheNotFound

    def scan_or_empty(*args, **kwargs):
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:
            return SimpleNamespace(repos=frozenset())

    scan_or_empty.empty_without_cache = True
    return scan_or_empty


@dataclass
class Server:
    """mlx-lm's server (its HTTP handler and generation thread) on a store,
    listening but not yet serving: ``serve_forever`` or ``serve_in_thread``."""

    store: PrefixStore
    prompt_cache: StorePromptCache
    generator: Any  # mlx_lm.server.ResponseGenerator
    httpd: Any  # mlx_lm.server.ThreadingHTTPServer
    _thread: Optional[threading.Thread] = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def serve_in_thread(self) -> "Server":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kvstore-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, finish the generation thread and every insert, close the store."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()
        self.generator.stop_and_join()
        self.prompt_cache.close()
        self.store.close()


def start(argv: Sequence[str]) -> Server:
    """mlx-lm's server, configured from ``argv`` (all of ``mlx_lm.server``'s
    options plus ``kvstore serve``'s), on a new ``PrefixStore``."""
    import mlx_lm.server as S

    store_args, rest = parse_args(argv)
    got: dict = {}

    def capture(host, port, model_provider, *args, **kwargs):  # mlx-lm's main() ends by calling run()
        got.update(host=host, port=port, provider=model_provider)

    S.load = _load_gguf_too(S.load)  # the generation thread loads the model later, through this name
    S.scan_cache_dir = _empty_without_hf_cache(S.scan_cache_dir)  # GET /v1/models
    run, argv0 = S.run, sys.argv
    S.run, sys.argv = capture, ["mlx_lm.server", *rest]
    try:
        S.main()  # parses mlx-lm's options as mlx-lm does, sets up logging, builds the ModelProvider
    finally:
        S.run, sys.argv = run, argv0
    config = store_config(**store_args)  # a bad store option is an error now, before the model loads
    provider = got["provider"]
    try:  # here, not first in the generation thread: there a model that cannot load left a server answering 404s
        provider.load_default()
    except Exception as e:
        raise ModelLoadError.of(provider.cli_args.model, e) from None
    if store_args["ssd_path"] is None:
        log.warning("kvstore serve: no --ssd-path: the store is RAM-only (its cache ends with the server); "
                    "give --ssd-path DIR to keep it across restarts")
    store = PrefixStore(config)
    try:
        prompt_cache = StorePromptCache(store, provider)
        prompt_cache.prepare(provider.model_key)  # calibration: before the port answers, not in a request
        fingerprint = S.get_system_fingerprint()
        # as mlx-lm's _run_http_server: the address family the host resolves to (IPv6 too)
        family, _, _, _, address = socket.getaddrinfo(got["host"], got["port"], type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        server_class = type("HTTPServer", (S.ThreadingHTTPServer,), {"address_family": family})
        handler = with_metrics(S.APIHandler, store)  # GET /metrics: the store's kvstore_* series
        httpd = server_class(address, lambda *a, **k: handler(generator, *a, system_fingerprint=fingerprint, **k))
    except BaseException:
        store.close()
        raise
    generator = S.ResponseGenerator(provider, prompt_cache)  # starts the generation thread (the model is loaded)
    log.info("kvstore: mlx-lm server on the store at %s port %d", got["host"], httpd.server_address[1])
    return Server(store, prompt_cache, generator, httpd)


def serve(argv: Optional[Sequence[str]] = None) -> None:
    """``kvstore serve``: mlx-lm's server (all its options) on a PrefixStore."""

    def stop(signum, frame):  # SIGTERM skips atexit by default: turn it into a clean shutdown
        raise KeyboardInterrupt

    server = start(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        log.info("kvstore: store closed, pending blocks written")
    # mlx-lm's generation thread cannot be joined at interpreter exit (its C++
    # side aborts); everything of ours is on disk now, so leave at once.
    logging.shutdown()
    os._exit(0)
