"""PrefixStore: the longest stored prefix of a prompt, as ready arrays.

The data flow, threads included::

    put (engine thread)     tokens --hash--> BlockTable.plan_put (new blocks indexed, marked with the put's id)
                                --> Writer.register_put / submit (the writer owns the put from here)
    writer thread           the put --encode (codec)--> Stored bytes --> BlockTable.encoded: RAM
                                --> Feed --> commit thread: Disk.write (LMDB) --> table.disk.written
                                --> remote write-behind queue --> remote thread: Redis / Valkey
    fetch (engine thread)   ``FetchPath`` (flow/fetch.py): tokens --hash--> BlockTable.lookup
                                (+ Disk.discover where the index cannot serve as far as asked)
                                --> Discovery.find (remote, what the local tiers lack: streamed, each
                                    block checked and placed in the hit's arrays as it comes)
                                --> BlockTable.pin (the servable path, where each block is, queued puts)
                                --> Planner.plan (what is worth loading) --> Reader.read:
                                device copies / RAM / LMDB pages / remote bytes --check, gather--> layers
                                (+ a queued put's rows: Writer.queued_rows) --> BlockTable.served, Counters
    promote thread          blocks served from disk --copy--> BlockTable.promoted: RAM

The ``BlockTable`` owns every block's state (index, RAM, disk LRU, pins) and
its lock, and hands out immutable ``BlockRef``s (its ``Node``s never leave
kvstore/state/); ``FetchPath``, ``Reader``, ``Writer``, ``Disk``,
``Discovery`` and ``Planner`` ask it, never each other's state, do their I/O
outside its lock, and hand what they did back to it by ref. This module is
the facade: it checks input and hands each call to its path. Every block
served is checked against the prompt's own tokens, so a hash collision or a
bad block shortens the hit; it never serves KV of another prompt and never
raises a storage fault into the engine.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from dataclasses import replace
from functools import partial
from typing import Optional, Sequence, Union

import numpy as np

from .blocks.codec import Codec
from .blocks.hashing import KeyChain, as_tokens, root_key
from .blocks.layers import Layer
from .config import DEFAULT_BLOCK, StoreConfig, gib, init_signature, store_config
from .cost.model import CostModel
from .cost.planner import Planner
from .counters import Counters
from .admin.catalog import display_names
from .errors import InputError, ReadOnlyError, StoreClosedError
from .flow.discovery import Discovery
from .flow.explain import Explanation, explain
from .flow.disk import Disk
from .flow.fetch import FetchPath
from .flow.priority import EngineFirst
from .flow.put import index_put, warm_put
from .flow.reader import Reader
from .flow.writer import Writer
from .gpu import buffers
from .gpu.backend import choose
from .hit import Hit
from .inspection import Inspection
from .state.table import BlockTable
from .tiers.disk.lmdb import LmdbTier
from .tiers.remote.sync import Remote
from .warmup import warm_device

log = logging.getLogger("kvstore")


class PrefixStore(Inspection):
    """A tiered, persistent prefix cache of KV arrays.

    >>> store = PrefixStore(budget_gb=1)                 # RAM only
    >>> store.put("model", tokens, layers)               # doctest: +SKIP
    >>> hit = store.fetch("model", tokens)               # doctest: +SKIP

    Settings are keywords (or one ``config``): ``kvstore.config.StoreConfig`` lists and explains them;
    ``PrefixStore(config, budget_gb=8)`` varies one. Raises ``ConfigError`` for settings out of range
    (``RemoteConfigError`` for a malformed URL or refused credentials) and ``StoreOpenError`` for an
    ``ssd_path`` it cannot use.
    """

    def __init__(self, config: Optional[StoreConfig] = None, **settings):
        self.config = cfg = store_config(config, **settings)
        self.block_size = cfg.block_size or DEFAULT_BLOCK  # an LMDB store's own, once it is open (below)
        self.codec = Codec.of(cfg)
        self.backend = backend = choose()  # where arrays live (CUDA, Metal, CPU): asked once, handed to all
        # a fetch of blocks still queued may take the put's own rows through the codec (``queued``), unless a
        # reuse has to be seen stored (ssd_admit="reuse")
        self._from_queued = cfg.ssd_admit == "always"
        self.namespace = cfg.namespace
        self.readonly = cfg.readonly
        self._counters = Counters()
        self._cost = CostModel(cfg.fetch_policy, margin=cfg.tuning.serve_margin)
        self._warned: set[str] = set()
        self._registered: set[bytes] = set()
        self._table = BlockTable(cfg.ram_bytes, self._counters, has_disk=cfg.ssd_path is not None,
                                 writable=not cfg.readonly, device_budget=cfg.device_bytes(backend),
                                 admit_on_reuse=cfg.ssd_admit == "reuse")
        self._disk: Optional[Disk] = None
        self._remote = None if cfg.remote is None else Remote(cfg.remote, cfg.namespace, self._counters, cfg)
        if cfg.ssd_path is not None:
            try:
                tier = LmdbTier.open(cfg.ssd_path, cfg.disk_bytes, readonly=cfg.readonly)
            except BaseException:
                if self._remote is not None:
                    self._remote.close()
                raise
            self._disk = Disk(tier, self._table, self._counters, cfg, self._warn)
        self._reader = Reader(self._table, self._disk, self._counters, writable=not cfg.readonly, backend=backend)
        self._planner = Planner(self._cost, self._disk, cfg, backend)
        self._engine = EngineFirst(cfg.tuning.writer_patience_s)
        self._writer = Writer(self._table, self._disk, self.codec, self._counters, cfg, on_idle=self._save,
                              remote=None if cfg.readonly else self._remote, engine=self._engine, backend=backend)
        self._discovery = None if self._remote is None else Discovery(
            self._remote, self._table, self._counters, cfg,
            keep_on_disk=self._disk is not None and not cfg.readonly, register=self._writer.register_copies, backend=backend)
        self._closed = False
        if self._disk is not None:
            self._disk.load_index()
            self.block_size = self._disk.block_size(cfg.block_size)
        self.config = cfg = replace(cfg, block_size=self.block_size)
        self._fetch = FetchPath(self._table, self._disk, self._discovery, self._planner, self._reader, self._writer,
                                self._counters, self._engine, block_size=self.block_size,
                                from_queued=self._from_queued,
                                reuse=self._admit_reused if cfg.ssd_admit == "reuse" and not cfg.readonly else None)
        self._planner.start()  # measured rates saved earlier, else priors (``probe``)
        warm_device(cfg, type(self), backend)  # on CUDA, what a process's first hits would pay (``warmup``), once
        if not cfg.readonly:
            self._writer.later(lambda: None)  # starts its thread here, not in the first put (a third of its cost)
            warm_put(self.block_size)
            # The young generations collected now, not in the first put: after a process's imports they hold
            # most of its objects, and the put's allocations would set off their collection (docs/benchmarks.md).
            gc.collect(1)
        _OPEN.add(self)

    # ------------------------------------------------------------ public API

    def put(self, model_key: Union[str, bytes], tokens, layers: Sequence[Layer]) -> int:
        """Keep the KV of ``tokens``: the blocks not stored yet are queued.

        ``layers`` holds, per model layer, a ``KVLayer`` whose rows end at ``len(tokens)`` or a
        ``StateLayer`` taken after the last token. Returns the number of new blocks queued: 0 also when the
        writer is so far behind that the put is skipped whole (``puts_skipped``; it never waits). Raises
        ``LayoutError`` for arrays that do not fit the tokens; storage faults are logged, never raised.
        """
        t0 = time.perf_counter()
        self._check_open(write=True)
        with self._engine.engine():
            n, pending = index_put(self._table, lambda: self._root(model_key), tokens, layers, self.block_size,
                                   self._writer.register_put)
        queued = self._writer.submit(pending) if pending else 0
        self._admit_reused()
        if n:  # (one lock: timed and counted, so the histogram's count is ``puts``)
            self._counters.observe("put", time.perf_counter() - t0, "puts")
        return queued

    def fetch(self, model_key: Union[str, bytes], tokens, *, limit: Optional[int] = None,
              quantized: Optional[tuple[int, int]] = None) -> Hit:
        """KV of the longest stored prefix of ``tokens`` (at most ``limit`` tokens).

        Layers come back dense in their stored dtype, or, with
        ``quantized=(bits, group_size)``, as ``Quantized`` with those settings
        (entries stored so are handed over as they are). A miss is
        ``Hit(0, None)``. Never raises for what is stored.
        """
        self._check_open()
        toks, n = _asked(tokens, limit)
        return self._fetch.fetch(self._root(model_key, register=False), toks, n, quantized)

    def explain(self, model_key: Union[str, bytes], tokens, *, limit: Optional[int] = None) -> Explanation:
        """What ``fetch`` would serve of ``tokens`` now and why, block by block, loading and changing nothing
        (a dry run: ``kvstore.flow.explain``): where each block is, what the cost model would choose, and a
        reason for every token it would not serve (``Explanation.not_served`` is what ``Hit.not_served``
        would say, where no read fails). Read-only beside engines: ``PrefixStore(ssd_path=..., readonly=True)``
        sees the disk (and the remote), not their RAM."""
        self._check_open()
        toks, n = _asked(tokens, limit)
        root = self._root(model_key, register=False)
        names = display_names(self._disk.models()) if self._disk is not None else {}
        tiers = ["device"] * (self.config.device_bytes(self.backend) > 0) + ["ram"] + ["disk"] * (
            self._disk is not None) + ["remote"] * (self._remote is not None)
        model = names.get(root) or (model_key if isinstance(model_key, str) else model_key.hex())
        return explain(self._fetch, KeyChain(root, toks, self.block_size), n, model=model, tiers=tiers,
                       name_of=lambda r: names.get(r) or r.hex()[:16])

    def knows_prefill(self, model_key: Union[str, bytes]) -> bool:
        """Whether prefills of this model have been observed (here or by an earlier run on this machine)."""
        return self._cost.prefill_model(root_key(model_key, self.namespace).hex()) is not None

    def observe_request(self, model_key: Union[str, bytes], tokens: int, hit: Optional[Hit], seconds: float) -> None:
        """An engine's request of ``tokens`` took ``seconds`` from its fetch to its first token, after
        ``hit`` (``None`` or empty: a cold prefill). Adapters report this after each request; it is what
        ``fetch_policy="auto"`` learns prefill and the real cost of a hit from."""
        self._planner.observe_request(root_key(model_key, self.namespace).hex(), tokens, hit.length if hit else 0,
                                    hit.source_bytes if hit else {}, seconds)

    def observe_prefill(self, model_key: Union[str, bytes], start: int, stop: int, seconds: float) -> None:
        """The engine computed tokens ``[start, stop)`` after a cached prefix of ``start`` in ``seconds``
        (the adapters report this after each request): what ``fetch_policy="auto"`` weighs loading against."""
        self._cost.observe_prefill(root_key(model_key, self.namespace).hex(), start, stop, seconds)

    def set_context_ratio(self, model_key: Union[str, bytes], ratio: float) -> None:
        """The model's attention FLOPs per token of context over its weight FLOPs per token (the adapters
        tell it): lets ``fetch_policy="auto"`` predict long prefills from short ones."""
        self._cost.set_context_ratio(root_key(model_key, self.namespace).hex(), ratio)

    def contains(self, model_key: Union[str, bytes], tokens) -> int:
        """Length ``fetch`` would serve from the local tiers, loading nothing (ignores blocks found bad on
        load; never asks the remote)."""
        self._check_open()
        toks = as_tokens(tokens)
        root = self._root(model_key, register=False)
        match = self._fetch.match(root, KeyChain(root, toks, self.block_size), len(toks))
        return self._table.servable(match.path, match.matched)

    def register_model(self, model_key: Union[str, bytes], info: dict) -> None:
        """Describe a model (path, name, tokenizer) for ``kvstore inspect``."""
        self._check_open()
        if not isinstance(info, dict):
            raise InputError(f"info must be a dict, got {type(info).__name__}")
        self._root(model_key, info=info)

    def stats(self) -> dict:
        """Counters of this process plus bytes and blocks per tier."""
        self._check_open()
        out = self._counters.snapshot()
        out.update(self._table.stats(), pending_bytes=self._writer.pending_bytes,
                   pending_jobs=self._writer.pending_jobs, orphans=self.orphans,
                   pinned_made_bytes=buffers.made[0], pinned_made_s=buffers.made[1],
                   pageable_past_cap_bytes=buffers.made[2])  # (this process's, on CUDA)
        if self._disk is not None:
            out.update(self._disk.stats())
        if self._remote is not None:
            out.update(self._remote.stats())
        req = out["tokens_requested"]
        out["token_hit_rate"] = (out["tokens_ram"] + out["tokens_ssd"] + out["tokens_remote"]) / req if req else 0.0
        out["cost"] = self._cost.describe()
        return out

    @property
    def fetch_policy(self) -> str:
        """``"auto"``, ``"always"`` or ``"never"`` (see the class docstring); settable."""
        return self._cost.policy

    @fetch_policy.setter
    def fetch_policy(self, policy: str) -> None:
        self._cost.set_policy(policy)

    @property
    def orphans(self) -> int:
        """Blocks found on disk at open whose parent is missing (ignored)."""
        return 0 if self._disk is None else self._disk.orphans

    @property
    def nbytes(self) -> int:
        """Bytes held in the RAM tier."""
        return self._table.ram_bytes

    def set_budget(self, budget_gb: float) -> None:
        """Change the RAM budget; evicts at once when it shrinks."""
        self._check_open()
        self._table.set_ram_budget(gib(budget_gb, "budget_gb"))

    def trim_ram(self, n_bytes: int) -> None:
        """Evict RAM blocks until at most ``n_bytes`` are held (the budget stays; blocks with an SSD copy
        remain servable from there)."""
        self._check_open()
        _count(n_bytes, "n_bytes")
        self._table.trim_ram(int(n_bytes))

    def trim_device(self, n_bytes: int) -> None:
        """Drop device-tier copies until at most ``n_bytes`` of GPU memory are held (for an engine that
        needs the memory; the blocks stay in RAM or on disk). The budget stays: ``device_budget_gb``."""
        self._check_open()
        _count(n_bytes, "n_bytes")
        back = self._table.device.trim(int(n_bytes))
        if back:  # (copied back to RAM on the writer's thread)
            self._writer.later(partial(self._table.device.copy_back, back))

    def trim_disk(self, n_bytes: int) -> int:
        """Evict least recently used disk blocks (leaves first) until the disk tier uses at most
        ``n_bytes``; returns how many blocks left (the budget stays; nothing in a RAM-only or read-only store)."""
        self._check_open()
        _count(n_bytes, "n_bytes")
        if self._disk is None or self.readonly:
            return 0
        return self._disk.evict_to(int(n_bytes))

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued block is encoded and written (its remote copy sent or skipped), and
        blocks served from disk are in RAM."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._writer.flush(timeout)
        self._reader.settle()
        self._save()
        if self._remote is not None:
            self._remote.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Flush pending writes and release the LMDB store. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._writer.stop()
        self._reader.close()
        self._table.close()
        if self._remote is not None:
            self._remote.close()
        if self._disk is not None:
            self._disk.close()
        _OPEN.discard(self)

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._table)

    @property
    def sequences(self) -> int:
        """Stored entries: chains of blocks from a model's root to a leaf (what ``kvstore inspect`` lists)."""
        return self._table.leaves

    def clear(self) -> None:
        """Drop everything, in RAM and on disk (a shared remote tier is left alone: ``kvstore clear
        --remote URL`` acts there)."""
        self._check_open(write=True)
        self.flush()
        self._table.clear()
        if self._disk is not None:
            self._disk.remove_all()

    # --------------------------------------------------------------- lookup

    def _root(self, model_key, register: bool = True, info: Optional[dict] = None) -> bytes:
        """The model's root key (its blocks' chains start there), the model registered on first use."""
        key = root_key(model_key, self.namespace)
        if register and not self.readonly and key not in self._registered \
                and (self._disk is not None or self._remote is not None):
            self._registered.add(key)
            name = model_key if isinstance(model_key, str) else model_key.hex()
            desc = dict(info or {}, model_key=name, namespace=self.namespace, created=time.time(),
                        block_size=self.block_size)
            if self._disk is not None:
                if info is None:  # a put's implicit description: written by the writer, not while the engine waits
                    self._writer.later(partial(self._disk.register_model, key, desc))
                else:
                    self._disk.register_model(key, desc)
            if self._remote is not None:
                self._remote.register_model(key, desc)
        return key

    # ------------------------------------------------------------- helpers

    def _save(self) -> None:
        if self._disk is None or self.readonly:
            return
        self._disk.save()
        self._planner.save_rates()

    def _admit_reused(self) -> None:
        """Queue the disk writes of blocks asked for again (``ssd_admit="reuse"``)."""
        leaves = self._table.admissions.take()
        if leaves:
            self._writer.admit(leaves)

    def _warn(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg)

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise StoreClosedError("this PrefixStore is closed; open a new one")
        if write and self.readonly:
            raise ReadOnlyError("this PrefixStore was opened read-only; open it without readonly=True to write")


def _asked(tokens, limit: Optional[int]) -> tuple[np.ndarray, int]:
    """A fetch's prompt as tokens, and how many of them it asks for (``InputError`` for a bad ``limit``)."""
    toks = as_tokens(tokens)
    if limit is not None:
        _count(limit, "limit")
    return toks, len(toks) if limit is None else min(len(toks), int(limit))


def _count(value, name: str) -> None:
    """``InputError`` unless ``value`` is an int >= 0 (a str such as "5" is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InputError(f"{name} must be an int >= 0, got {value!r}")


PrefixStore.__init__.__signature__ = init_signature()

_OPEN: "weakref.WeakSet[PrefixStore]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Interpreter exit flushes what is still queued (close() does the same)."""
    for store in list(_OPEN):
        try:
            store.close()
        except Exception:
            log.exception("kvstore: closing a store at exit failed")
