"""mlx-lm's server on the store.

``StorePromptCache`` has the interface ``mlx_lm.server`` expects of its
``LRUPromptCache`` (``fetch_nearest_cache``, ``insert_cache``, ``trim_to``,
``nbytes``, ``__len__``, ``stats_by_type``), so the server, continuous batching
included, runs unchanged on a ``PrefixStore``: caches survive restarts, are
kept quantized and spill to SSD. Every request the server caches is cached
here too: text, prompts with images (keyed by mlx-lm's ``Vision.cache_key``,
whose patch tokens are negative 64-bit ids) and speculative decoding (main and
draft model cached together). ``start`` builds mlx-lm's own server on a store;
``serve`` runs it (``kvstore serve``).
"""

from __future__ import annotations

import argparse
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
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as C

from kvstore import Hit, PrefixStore
from kvstore.config import store_config

from .file_digests import changed_since
from .generate import calibrate_once, models_key, needs_snapshots, prefill
from .gguf import TRAINED, is_gguf, load_model, resolve_model
from .loading import ModelLoadError
from .inserts import Inserts
from .metrics import with_metrics
from .fingerprints import ADAPTER_FILES, adapter_fingerprint
from .mlx_lm import cache_offset, layers_to_caches, snapshot

log = logging.getLogger("kvstore")

GB = 1 << 30  # PrefixStore's budget unit


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
            if whole == hit.length:
                return hit
            if whole == 0:
                return Hit()
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
        local, draft_local = _folder(path), _folder(draft)
        key = _loaded_key(provider.model, local, adapter, models[1] if draft is not None else None)
        if local:
            info = {"path": str(local.resolve()), "name": local.name}
            if draft is not None:
                info["draft"] = str(draft_local.resolve()) if draft_local else str(draft)
            self.store.register_model(key, info)
        m = _Models(key, models, [len(C.make_prompt_cache(x)) for x in models])
        self._models[model] = m
        calibrate_once(self.store, key, models)  # the server's prefills cannot be timed from here
        return m


def _folder(path: Any) -> Optional[Path]:
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
    files = [] if local is None else [local] if local.is_file() else [p for p in local.iterdir() if p.is_file()]
    files += [Path(adapter, n) for n in ADAPTER_FILES] if adapter else []
    loaded = getattr(model, "_kvstore_loaded_ns", None)
    if local is None or loaded is None or changed_since(files, loaded):
        return models_key(model, None, draft_model=draft_model)
    return models_key(model, local, draft_model=draft_model,
                      extra=f"adapter={adapter_fingerprint(adapter)}" if adapter else "")


def _load_gguf_too(load):
    """mlx-lm's ``load``, which also takes a GGUF file or a trained model's
    name (``smollm2``, ``gemma3``) and reads it with ``load_gguf``."""
    if getattr(load, "reads_gguf", False):
        return load

    def load_any(path, *args, return_config: bool = False, **kwargs):
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


# ---------------------------------------------------------------------------
# kvstore serve
# ---------------------------------------------------------------------------

_SIZE_REFUSED = ("--prompt-cache-size counts cached sequences; the store is bounded by bytes instead: "
                 "use --budget-gb (RAM) or --prompt-cache-bytes, and --disk-budget-gb (SSD)")


def _parser(prog: str = "kvstore serve",
            usage: str = "kvstore serve --model PATH [store options] [mlx_lm.server options]") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False, usage=usage)
    g = p.add_argument_group("the store's options")
    g.add_argument("--ssd-path", default=None, metavar="DIR",
                   help="the store's directory on SSD (kept across restarts); without it the store is RAM-only")
    g.add_argument("--budget-gb", type=float, default=None, help="RAM budget of the store in GiB (default 4)")
    g.add_argument("--disk-budget-gb", type=float, default=None,
                   help="SSD budget in GiB (default: half the free space, at most 64)")
    g.add_argument("--store-kv-bits", default=None,
                   help="bits of stored entries: 8, 4, or K,V like 8,4 (default: as the engine holds them)")
    g.add_argument("--store-group-size", type=int, default=64, help="quantization group size (default 64)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per stored block of a new store (default 256; a store keeps the one it was made with)")
    g.add_argument("--namespace", default=None, help="a tenant: stores of other namespaces share nothing")
    g.add_argument("--fetch-policy", default="auto", choices=["auto", "always", "never"],
                   help="auto: load a hit only where that beats recomputing it (rates measured here)")
    g.add_argument("--ssd-admit", default="always", choices=["always", "reuse"],
                   help="always: write every block to SSD; reuse: only blocks asked for again (fewer SSD writes)")
    g.add_argument("--calibrate-budget-s", type=float, default=3.0,
                   help="auto: seconds a model's first request may spend timing its prefill (default 3; 0: none)")
    g.add_argument("--remote", default=None,
                   help="a Redis / Valkey server or cluster shared by hosts: redis://[:password@]host:port/db, "
                        "rediss://..., unix:///path.sock (password also from $KVSTORE_REMOTE_PASSWORD)")
    g.add_argument("--remote-timeout", type=float, default=0.5, help="seconds per remote call (default 0.5)")
    g.add_argument("--remote-secret", default=None,
                   help="sign remote blocks and serve only signed ones (better: $KVSTORE_REMOTE_SECRET, which stays "
                        "out of process lists)")
    # mlx-lm's own cache options, mapped onto the store or refused
    g.add_argument("--prompt-cache-bytes", default=None,
                   help="mlx-lm's option: here the store's RAM budget (instead of --budget-gb), e.g. 4GB")
    g.add_argument("--prompt-cache-size", default=None, help=argparse.SUPPRESS)
    return p


def usage() -> str:
    """``kvstore serve --help``: the store's options, then mlx-lm's server
    options less the one refused here (``--prompt-cache-size``)."""
    import contextlib
    import io

    import mlx_lm.server as S

    buf, argv0 = io.StringIO(), sys.argv
    sys.argv = ["mlx_lm.server", "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            S.main()
    except SystemExit:
        pass
    finally:
        sys.argv = argv0
    text = buf.getvalue()
    theirs, skipping = [], False
    for line in text[text.find("\n\n") + 2:].splitlines():  # (after mlx-lm's usage lines)
        if line.startswith("  -"):
            skipping = line.lstrip().startswith("--prompt-cache-size")
        elif not line.startswith("   "):
            skipping = False
        if not skipping:
            theirs.append(line)
    return (_parser().format_help() + "\nmlx_lm.server's options (all work here, but --prompt-cache-size: "
            + _SIZE_REFUSED + "):\n" + "\n".join(theirs))


def parse_kv_bits(text: Optional[str]) -> Union[None, int, tuple[int, int]]:
    """A command line's stored-entry bits: ``8``, or ``K,V`` like ``8,4``
    (``PrefixStore``'s ``kv_bits``); ``None`` for none given."""
    if not text:
        return None
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ValueError(f"{text!r} is not bits (8, 4, or K,V like 8,4)")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """``kvstore serve``'s own options as ``PrefixStore`` arguments, and the
    rest for mlx-lm's server. mlx-lm's ``--prompt-cache-bytes`` is the RAM
    budget (and stays with mlx-lm, which keeps running requests' caches
    within it too); ``--prompt-cache-size`` is refused (exit code 2)."""
    parser = _parser()
    opts, rest = parser.parse_known_args(list(argv))
    if opts.prompt_cache_size is not None:
        parser.error(_SIZE_REFUSED)
    budget_gb = 4.0 if opts.budget_gb is None else opts.budget_gb
    if opts.prompt_cache_bytes is not None:
        if opts.budget_gb is not None:
            parser.error("--prompt-cache-bytes and --budget-gb both set the store's RAM budget: give one")
        from mlx_lm.utils import _parse_size  # the parser mlx-lm reads this option with

        try:
            budget_gb = _parse_size(opts.prompt_cache_bytes) / GB
        except Exception:
            parser.error(f"--prompt-cache-bytes: {opts.prompt_cache_bytes!r} is not a size (e.g. 512M, 4GB)")
        rest += ["--prompt-cache-bytes", opts.prompt_cache_bytes]
    try:
        bits = parse_kv_bits(opts.store_kv_bits)
    except ValueError as e:
        parser.error(f"--store-kv-bits: {e}")
    store_args = dict(budget_gb=budget_gb, ssd_path=opts.ssd_path, block_size=opts.block_size, kv_bits=bits,
                      kv_group_size=opts.store_group_size, namespace=opts.namespace,
                      disk_budget_gb=opts.disk_budget_gb, fetch_policy=opts.fetch_policy, remote=opts.remote,
                      remote_timeout=opts.remote_timeout, remote_secret=opts.remote_secret,
                      calibrate_budget_s=opts.calibrate_budget_s, ssd_admit=opts.ssd_admit)
    return store_args, rest


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
