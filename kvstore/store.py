"""PrefixStore: the longest stored prefix of a prompt, as ready arrays.

The data flow, threads included::

    put (engine thread)     tokens --hash--> BlockTable.index_put --> Job --> writer queue
    writer thread           Job --encode (codec)--> Stored bytes --> BlockTable.admit (RAM)
                                --> Feed --> commit thread: Disk.write (LMDB) --> BlockTable.written
                                --> remote write-behind queue --> remote thread: Redis / Valkey
    fetch (engine thread)   tokens --hash--> BlockTable.walk (+ Disk.discover where it ends)
                                --> Discovery.find (remote, what the local tiers lack: streamed, each
                                    block checked and placed in the hit's arrays as it comes)
                                --> Planner.plan (what is worth loading) --> Reader.read:
                                device copies / RAM / LMDB pages / remote bytes --check, gather--> layers
    promote thread          blocks served from disk --copy--> BlockTable.promote (RAM)

The ``BlockTable`` owns every block's state (index, RAM, disk LRU, pins) and
its lock; ``Reader``, ``Writer``, ``Disk``, ``Discovery`` and ``Planner``
ask it, never each other, and do their I/O outside its lock. This module is
the facade: it checks input and sequences them. Every block served is
checked against the prompt's own tokens, so a hash collision or a bad block
shortens the hit; it never serves KV of another prompt and never raises a
storage fault into the engine.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import time
import weakref
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from . import buffers, lookup
from .codec import Codec, layer_arrays
from .config import DEFAULT_BLOCK, StoreConfig, gib, store_config
from .cost import CostModel
from .counters import Counters
from .discovery import Discovery, Found
from .disk import Disk
from .errors import InputError, ReadOnlyError, StoreClosedError
from .hashing import KeyChain, as_tokens, root_key
from .index import Node
from .layers import WARM_LAYERS, KVLayer, Layer, StateLayer, captured_layers
from .planner import Planner
from .priority import EngineFirst
from .queued import rows_of_queued
from .reader import Reader
from .remote_sync import Remote
from .table import BlockTable
from .tiers.lmdb import LmdbTier
from .warmup import warm_device
from .writer import Job, Writer

log = logging.getLogger("kvstore")


def _index_put(table: BlockTable, root_of: Callable[[], Node], tokens, layers: Sequence[Layer],
               block_size: int) -> tuple[int, Optional[Job]]:
    """A put's work on the engine's thread but queueing its job: the input
    checked and captured, the blocks ``table`` lacks hashed and indexed, and
    their job (``None`` when none is new). Returns the token count too."""
    toks = as_tokens(tokens)
    n = len(toks)
    layers = captured_layers(layers, n)  # the values of now, whatever the caller changes later
    if n == 0:
        return 0, None
    # Evaluate here: mlx streams are per thread, so the background thread cannot evaluate a lazy graph
    # built on the caller's (a no-op when the engine evaluated its cache, as it does after every step).
    # The second call marks each array's record available, here: mlx does that the first time it finds the
    # computation done, from whichever thread asks, and the writer may hold the engine's own records (the
    # engine's buffers, passed with ``rows``), whose status the engine's next step reads and writes.
    arrays = [a for l in layers for a in layer_arrays(l)]
    mx.eval(arrays)
    mx.eval(arrays)
    has_state = any(isinstance(l, StateLayer) for l in layers)
    late = [l for l in layers if isinstance(l, KVLayer) and l.start > 0]  # layers lacking early rows
    root = root_of()
    chain = KeyChain(root.key, toks, block_size)
    return n, table.index_put(root, chain, n, has_state, late,
                              lambda new: Job(new, root.key, toks, layers, sum(l.nbytes for l in layers),
                                              held=sum(a.nbytes for a in arrays)))


def _warm_put(block_size: int) -> None:
    """``_index_put`` once, at open, into a throwaway table: otherwise the
    engine's first put pays for Python's first pass over it, about twice its
    later ones (docs/benchmarks.md, put)."""
    table = BlockTable(0, Counters(), has_disk=False, writable=True)
    n = 2 * block_size + 1
    a = mx.zeros((1, 1, n + 1, 8), mx.float16)
    _index_put(table, lambda: table.root(root_key("warm")), np.arange(n, dtype=np.int32),
               [KVLayer(a, a, rows=n)] * WARM_LAYERS, block_size)


@dataclass
class Hit:
    """What ``fetch`` found: ``length`` prompt tokens whose KV is in ``layers``."""

    length: int = 0
    layers: Optional[list[Layer]] = None
    ram_tokens: int = 0  # of ``length``, tokens whose blocks came from RAM
    ssd_tokens: int = 0  # ... and from the LMDB tier
    skipped_tokens: int = 0  # stored tokens not served because recomputing them is faster
    skip_reason: str = ""
    predicted_s: float = 0.0  # what the cost model expected loading ``length`` to take
    remote_tokens: int = 0  # of ``length``, tokens whose blocks this fetch read from the remote tier
    source_bytes: dict = field(default_factory=dict)  # bytes served per source (``cost.STATES``)

    def __bool__(self) -> bool:
        return self.length > 0


class PrefixStore:
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
        # a fetch of blocks still queued may take the put's own rows through the codec (``queued``), unless a
        # reuse has to be seen stored (ssd_admit="reuse")
        self._from_queued = cfg.ssd_admit == "always"
        self.namespace = cfg.namespace
        self.readonly = cfg.readonly
        self._counters = Counters()
        self._cost = CostModel(cfg.fetch_policy, margin=cfg.serve_margin)
        self._warned: set[str] = set()
        self._registered: set[bytes] = set()
        self._table = BlockTable(cfg.ram_bytes, self._counters, has_disk=cfg.ssd_path is not None,
                                 writable=not cfg.readonly, device_budget=cfg.device_bytes(),
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
        self._reader = Reader(self._table, self._disk, self._counters, writable=not cfg.readonly)
        self._planner = Planner(self._cost, self._table, self._disk, self._counters, cfg)
        self._engine = EngineFirst(cfg.writer_patience_s)
        self._writer = Writer(self._table, self._disk, self.codec, self._counters, cfg, on_idle=self._save,
                              remote=None if cfg.readonly else self._remote, engine=self._engine)
        self._discovery = None if self._remote is None else Discovery(
            self._remote, self._table, self._counters, cfg,
            keep_on_disk=self._disk is not None and not cfg.readonly)
        self._closed = False
        if self._disk is not None:
            self._disk.load_index()
            self.block_size = self._disk.block_size(cfg.block_size)
        self.config = cfg = replace(cfg, block_size=self.block_size)
        self._planner.start()  # measured rates saved earlier, else priors (``probe``)
        warm_device(cfg)  # on CUDA, what a process's first hits would pay (``warmup``), once
        if not cfg.readonly:
            self._writer.later(lambda: None)  # starts its thread here, not in the first put (a third of its cost)
            _warm_put(self.block_size)
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
        self._check_open(write=True)
        with self._engine.engine():
            n, job = _index_put(self._table, lambda: self._root(model_key), tokens, layers, self.block_size)
        if n:
            self._counters.count("puts")
        queued = 0 if job is None else len(job.nodes) if self._writer.submit(job) else 0
        self._admit_reused()
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
        toks = as_tokens(tokens)
        if limit is not None:
            _count(limit, "limit")
        n = len(toks) if limit is None else min(len(toks), int(limit))
        root = self._root(model_key, register=False)
        chain = KeyChain(root.key, toks, self.block_size)
        match = self._match(root, chain, n)
        found = Found()  # blocks just read from the remote, served as they are
        copies: list = []  # ... and their disk copies, queued once the hit is served
        if self._discovery is not None and match.matched < n:
            found = self._discovery.find(root, chain, n, match, copies, quantized)
            if found.blocks:
                match = self._match(root, chain, n)
        length = self._table.servable(match.path, match.matched)
        pinned = [p for p in match.path if p.start < length]
        self._table.pin(pinned)
        try:
            jobs = self._table.unwritten_jobs(pinned, skip=found.blocks.keys())
            if jobs and self._from_queued and quantized is None and not found.blocks:
                with self._engine.engine():
                    queued = rows_of_queued(jobs, toks, length, self.codec)
                if queued is not None:  # the put still holds the rows: no wait for the writer
                    return self._queued_hit(len(toks), length, queued)
            if jobs:
                waited = time.perf_counter()
                for job in jobs:
                    job.done.wait()
                self._counters.count("fetch_waited_us", int((time.perf_counter() - waited) * 1e6))
            with self._engine.engine():  # (not around the wait above: the writer would wait for it)
                plan = self._planner.plan(root.key, len(toks), pinned, length, found.blocks)
                path = [p for p in pinned if p.start < plan.length]
                t0 = time.perf_counter()
                got = self._reader.read(path, toks, plan.length, quantized, plan.cold, found.blocks, found.fill)
                t_load = time.perf_counter() - t0
        finally:
            self._table.unpin(pinned)
            for job in copies:
                self._writer.submit(job)
        self._counters.count("tokens_requested", len(toks))
        self._counters.count("tokens_skipped_cost", plan.skipped)
        length, layers, from_ram = got.length, got.layers, got.from_ram
        if length == 0:
            self._counters.count("misses")
            return Hit(skipped_tokens=plan.skipped, skip_reason=plan.reason)
        served = [(p, r) for p, r in zip(path, from_ram) if p.start < length]
        if self.config.ssd_admit == "reuse" and not self.readonly:  # asked for again: its chain may go to disk
            self._table.reused(served[-1][0])
            self._admit_reused()
        remote_tokens = sum(min(p.end, length) - p.start for p, _ in served if p.key in found.blocks)
        ram_tokens = sum(min(p.end, length) - p.start for p, r in served if r and p.key not in found.blocks)
        hit = Hit(length, layers, ram_tokens=ram_tokens, ssd_tokens=length - ram_tokens - remote_tokens,
                  skipped_tokens=plan.skipped, skip_reason=plan.reason,
                  predicted_s=plan.load_s if length == plan.length else 0.0, remote_tokens=remote_tokens)
        hit.source_bytes = self._planner.observe(path, got.nbytes, from_ram, length, plan, t_load)
        self._counters.count("hits")
        self._counters.count("tokens_ram", hit.ram_tokens)
        self._counters.count("tokens_ssd", hit.ssd_tokens)
        self._counters.count("tokens_remote", hit.remote_tokens)
        return hit

    def _queued_hit(self, n: int, length: int, layers: list) -> Hit:
        """A hit copied from a put the writer has not stored yet (``queued``)."""
        self._counters.count("tokens_requested", n)
        self._counters.count("hits")
        self._counters.count("tokens_ram", length)
        self._counters.count("tokens_queued", length)
        return Hit(length, layers, ram_tokens=length)

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
        match = self._match(root, KeyChain(root.key, toks, self.block_size), len(toks))
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
            tier = self._disk.tier
            out.update(ssd_bytes=tier.usage(), ssd_budget=tier.budget, ssd_blocks=self._table.disk_blocks,
                       ssd_path=str(tier.path))
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
        self._table.trim_device(int(n_bytes))

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
            self._disk.tier.close()
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
            self._disk.tier.remove_all()

    # --------------------------------------------------------------- lookup

    def _root(self, model_key, register: bool = True, info: Optional[dict] = None) -> Node:
        key = root_key(model_key, self.namespace)
        if register and not self.readonly and key not in self._registered \
                and (self._disk is not None or self._remote is not None):
            self._registered.add(key)
            name = model_key if isinstance(model_key, str) else model_key.hex()
            desc = dict(info or {}, model_key=name, namespace=self.namespace, created=time.time())
            if self._disk is not None:
                if info is None:  # a put's implicit description: written by the writer, not while the engine waits
                    self._writer.later(partial(self._disk.register_model, key, desc))
                else:
                    self._disk.register_model(key, desc)
            if self._remote is not None:
                self._remote.register_model(key, desc)
        return self._table.root(key)

    def _match(self, root: Node, chain: KeyChain, n: int) -> lookup.Match:
        """The stored blocks along ``chain.tokens[:n]``, looking on disk (outside
        the table's lock) for blocks other processes wrote where the index
        ends, and for one block the prompt ends or diverges inside of."""
        looked: set[bytes] = set()
        while True:
            full = self._table.walk(root, chain, n)
            stop = full.last
            if (self._disk is None or stop.key in looked or full.length >= n
                    or not (stop.is_root or stop.on_disk)):
                break
            # partial blocks other processes wrote below the stop are found only on disk, even where
            # this process has children of its own there
            looked.add(stop.key)
            self._disk.discover(stop)
        match = lookup.Match(full, list(full.nodes), full.length)
        if full.length < n:
            candidates = self._table.candidates(stop, chain, full.length, n)
            best, shared = lookup.best_partial(candidates, chain, full.length, n, self._reader.tokens_of)
            if best is not None:
                match.path.append(best)
                match.matched += shared
        return match

    # ------------------------------------------------------------- helpers

    def _save(self) -> None:
        if self._disk is None or self.readonly:
            return
        self._disk.save()
        self._planner.save_rates()

    def _admit_reused(self) -> None:
        """Queue the disk writes of blocks asked for again (``ssd_admit="reuse"``)."""
        leaves = self._table.take_admissions()
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


def _count(value, name: str) -> None:
    """``InputError`` unless ``value`` is an int >= 0 (a str such as "5" is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InputError(f"{name} must be an int >= 0, got {value!r}")


def _signature() -> inspect.Signature:
    """``PrefixStore(config=None, *, <StoreConfig's fields>)``: what ``help()`` and editors show of the
    keywords ``__init__`` takes as ``**settings``."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation=Optional[StoreConfig])]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in fields(StoreConfig)]
    return inspect.Signature(params)


PrefixStore.__init__.__signature__ = _signature()

_OPEN: "weakref.WeakSet[PrefixStore]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Interpreter exit flushes what is still queued (close() does the same)."""
    for store in list(_OPEN):
        try:
            store.close()
        except Exception:
            log.exception("kvstore: closing a store at exit failed")
