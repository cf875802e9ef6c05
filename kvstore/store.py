"""PrefixStore: the longest stored prefix of a prompt, as ready arrays.

Data flows one way each direction::

    put:   layers --slice per block--> codec --> RAM tier --(write-through)--> LMDB
    fetch: tokens --hash--> index walk --> blocks from RAM or LMDB --concat--> layers

``put`` only hashes, looks up and queues: slicing, quantizing and writing run on
one background thread, so the engine is blocked for well under a millisecond.
A ``fetch`` that reaches a block still being encoded waits for it. Every block
served is checked against the prompt's own tokens, so a hash collision or a bad
block shortens the hit; it never serves KV of another prompt and never raises
a storage fault into the engine.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .codec import Block, Codec, block_arrays, convert, deserialize, layer_arrays, serialize
from .errors import BlockDecodeError, LayoutError, StoreOpenError
from .hashing import KeyChain, as_tokens, root_key
from .index import FULL_GAP, NO_GAP, Node, RadixIndex
from .layers import KVLayer, Layer, Quantized, StateLayer, Tensor, take_rows
from .spread import spread
from .tiers.lmdb import LmdbTier, Record
from .tiers.ram import RamTier

log = logging.getLogger("kvstore")

GB = 1 << 30
_WRITE_BATCH = 64 << 20  # bytes per LMDB write transaction
_FULL_PAUSE = 30.0  # seconds without disk writes after the device filled up and evicting could not help


@dataclass
class Hit:
    """What ``fetch`` found: ``length`` prompt tokens whose KV is in ``layers``."""

    length: int = 0
    layers: Optional[list[Layer]] = None
    ram_tokens: int = 0  # of ``length``, tokens whose blocks came from RAM
    ssd_tokens: int = 0  # ... and from the LMDB tier

    def __bool__(self) -> bool:
        return self.length > 0


@dataclass
class _Job:
    """Blocks of one ``put`` waiting for the background thread."""

    nodes: list[Node]
    tokens: np.ndarray
    layers: list[Layer]
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)


_COUNTERS = ("hits", "misses", "tokens_requested", "tokens_ram", "tokens_ssd", "puts", "blocks_written",
             "evictions_ram", "evictions_ssd", "sync_writes", "corrupt_blocks", "write_errors", "blocks_stored",
             "puts_inline")  # puts done in the caller because the background thread was far behind


class PrefixStore:
    """A tiered, persistent prefix cache of KV arrays.

    >>> store = PrefixStore(budget_gb=1)                 # RAM only
    >>> store.put("model", tokens, layers)               # doctest: +SKIP
    >>> hit = store.fetch("model", tokens)               # doctest: +SKIP

    ``budget_gb`` bounds the RAM tier; with ``ssd_path`` every block is also
    written to an LMDB store there (write-through, in the background) that
    survives restarts and may be shared by several processes, bounded by
    ``disk_budget_gb`` (default: half the free space, at most 64 GiB).
    ``kv_bits`` stores KV quantized (an int, or ``(key_bits, value_bits)``);
    ``None`` keeps the engine's dtype. ``rotate_keys`` rotates keys before
    quantizing them (``kvstore.rotation``; ``None``: at 4 bits or fewer).
    Entries remember their own settings, so
    a store reopened with other settings reads old entries correctly.
    ``namespace`` salts every key: tenants never share or see blocks.
    """

    def __init__(self, budget_gb: float = 4.0, ssd_path=None, block_size: int = 256,
                 kv_bits: Union[None, int, tuple[Optional[int], Optional[int]]] = None,
                 kv_group_size: int = 64, namespace: Optional[str] = None,
                 disk_budget_gb: Optional[float] = None, *, readonly: bool = False,
                 rotate_keys: Optional[bool] = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if budget_gb < 0:
            raise ValueError(f"budget_gb must be >= 0, got {budget_gb}")
        self.block_size = int(block_size)
        self.codec = Codec.from_bits(kv_bits, kv_group_size, rotate_keys)
        self.namespace = namespace
        self.readonly = readonly
        self._lock = threading.RLock()
        self._index = RadixIndex()
        self._ram = RamTier(int(budget_gb * GB))
        self._disk: Optional[LmdbTier] = None
        if ssd_path is not None:
            budget = None if disk_budget_gb is None else int(disk_budget_gb * GB)
            self._disk = LmdbTier(ssd_path, budget, readonly=readonly)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._unsaved = dict.fromkeys(_COUNTERS, 0)  # lifetime counters not yet in LMDB
        self._uses: dict[bytes, tuple[float, int]] = {}
        self._roots: dict[bytes, tuple[bytes, dict]] = {}  # root key -> model info to register
        self._warned: set[str] = set()
        self._full_at: Optional[float] = None  # when a full device last stopped writes to it
        self._queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._pending_bytes = 0
        self._max_pending = max(256 << 20, self._ram.budget)
        self._closed = False
        self._worker: Optional[threading.Thread] = None
        self.orphans = 0
        if self._disk is not None:
            self._load_index()
        _OPEN.add(self)

    # ------------------------------------------------------------ public API

    def put(self, model_key: Union[str, bytes], tokens, layers: Sequence[Layer]) -> int:
        """Keep the KV of ``tokens``: the blocks not stored yet are queued.

        ``layers`` holds, per model layer, a ``KVLayer`` whose rows end at
        ``len(tokens)`` or a ``StateLayer`` taken after the last token.
        Returns the number of new blocks. Raises ``LayoutError`` for arrays
        that do not fit the tokens; storage faults are logged, never raised.
        """
        self._check_open(write=True)
        toks = as_tokens(tokens)
        n = len(toks)
        _check_layers(layers, n)
        if n == 0:
            return 0
        # Evaluate here: mlx streams are per thread, so the background thread
        # cannot evaluate a lazy graph built on the caller's (a no-op when the
        # engine already evaluated its cache, as it does after every step).
        mx.eval([a for l in layers for a in layer_arrays(l)])
        has_state = any(isinstance(l, StateLayer) for l in layers)
        late = [l for l in layers if isinstance(l, KVLayer) and l.start > 0]  # layers lacking early rows
        bs = self.block_size
        root = self._root(model_key)
        chain = KeyChain(root.key, toks, bs)
        new: list[Node] = []
        with self._lock:
            node = root
            for i in range((n + bs - 1) // bs):
                start = i * bs
                length = min(bs, n - start)
                key = chain.key(i) if length == bs else chain.tail_key(i, length)
                child = self._child(node, key)
                end_here = start + length == n
                if child is not None and not (end_here and has_state and child.snap is False):
                    node = child
                    continue
                snap = (end_here if has_state else None)
                gap, rows_from = _gap(late, start, start + length)
                if gap == FULL_GAP:
                    break
                if child is not None:
                    # Stored without the state snapshot this put carries: re-encode it in place. The
                    # blocks below it stay (dropping them would lose other prompts' prefixes), and a job
                    # still encoding it leaves it to this one.
                    child.snap, child.gap, child.rows_from = True, gap, rows_from
                    node = child
                else:
                    node = self._index.add(node, key, start, length, int(toks[start]), snap, gap, rows_from)
                new.append(node)
            self._counters["puts"] += 1
            self._unsaved["puts"] += 1
            if not new:
                return 0
            job = _Job(new, toks, list(layers), sum(l.nbytes for l in layers))
            for nd in new:
                nd.job = job
            sync = self._pending_bytes + job.nbytes > self._max_pending and self._pending_bytes > 0
            if not sync:
                self._pending_bytes += job.nbytes
        if sync:  # the background thread is far behind: do this one here rather than queue without bound
            self._count("puts_inline")
            self._run_job(job)
        else:
            self._ensure_worker()
            self._queue.put(job)
        return len(new)

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
        n = len(toks) if limit is None else max(0, min(len(toks), int(limit)))
        root = self._root(model_key, register=False)
        chain = KeyChain(root.key, toks, self.block_size)
        with self._lock:
            path, matched = self._walk(root, chain, n)
            length = self._servable(path, matched)
            path = [p for p in path if p.start < length]
            RadixIndex.pin(path)
        try:
            for job in {id(p.job): p.job for p in path if p.job is not None}.values():
                job.done.wait()
            blocks, length, from_ram = self._load(path, toks, length)
        finally:
            with self._lock:
                RadixIndex.unpin(path)
                self._make_room(0)  # blocks promoted while pinned may have left RAM over budget
        self._counters["tokens_requested"] += len(toks)
        self._unsaved["tokens_requested"] += len(toks)
        if length == 0:
            self._count("misses")
            return Hit()
        try:
            layers = _assemble(blocks, length, quantized)
        except Exception as e:  # blocks that do not fit together (a reused model key, a bad index record)
            self._warn("assemble", f"kvstore: stored blocks for this prompt do not fit together ({e}); "
                                   f"serving a miss")
            self._count("misses")
            return Hit()
        ram_tokens = sum(min(b.end, length) - b.start for b, r in zip(path, from_ram) if r and b.start < length)
        hit = Hit(length, layers, ram_tokens, length - ram_tokens)
        self._count("hits")
        self._count("tokens_ram", hit.ram_tokens)
        self._count("tokens_ssd", hit.ssd_tokens)
        return hit

    def contains(self, model_key: Union[str, bytes], tokens) -> int:
        """Length ``fetch`` would serve, without loading anything (ignores
        blocks found bad on load)."""
        toks = as_tokens(tokens)
        root = self._root(model_key, register=False)
        with self._lock:
            return self._servable(*self._walk(root, KeyChain(root.key, toks, self.block_size), len(toks)))

    def register_model(self, model_key: Union[str, bytes], info: dict) -> None:
        """Describe a model (path, name, tokenizer) for ``kvstore inspect``."""
        self._root(model_key, info=info)

    def stats(self) -> dict:
        """Counters of this process plus bytes and blocks per tier."""
        with self._lock:
            out = dict(self._counters)
            out.update(
                ram_bytes=self._ram.nbytes, ram_blocks=len(self._ram), ram_budget=self._ram.budget,
                blocks_indexed=len(self._index), pending_bytes=self._pending_bytes,
                pending_jobs=self._queue.qsize(), orphans=self.orphans,
            )
        if self._disk is not None:
            out.update(ssd_bytes=self._disk.usage(), ssd_budget=self._disk.budget,
                       ssd_blocks=sum(1 for n in self._index if n.on_disk), ssd_path=str(self._disk.path))
        req = out["tokens_requested"]
        out["token_hit_rate"] = (out["tokens_ram"] + out["tokens_ssd"]) / req if req else 0.0
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held in the RAM tier."""
        return self._ram.nbytes

    def set_budget(self, budget_gb: float) -> None:
        """Change the RAM budget; evicts at once when it shrinks."""
        with self._lock:
            self._ram.budget = int(budget_gb * GB)
            self._make_room(0)

    def trim_ram(self, n_bytes: int) -> None:
        """Evict RAM blocks until at most ``n_bytes`` are held (the budget
        stays; blocks with an SSD copy remain servable from there)."""
        with self._lock:
            if n_bytes < self._ram.nbytes:
                self._make_room(self._ram.budget - n_bytes)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued block is encoded and written."""
        if self._worker is not None and self._worker.is_alive():
            self._queue.join() if timeout is None else _join(self._queue, timeout)
        self._save_uses()

    def close(self) -> None:
        """Flush pending writes and release the LMDB store. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=60)
        if self._disk is not None:
            self._disk.close()
        _OPEN.discard(self)

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._index)

    def clear(self) -> None:
        """Drop everything, in RAM and on disk."""
        self.flush()
        with self._lock:
            for r in self._index.roots():
                for child in list((r.children or {}).values()):
                    self._forget(child)
            if self._disk is not None:
                self._disk.remove_all()

    # --------------------------------------------------------------- lookup

    def _root(self, model_key, register: bool = True, info: Optional[dict] = None) -> Node:
        key = root_key(model_key, self.namespace)
        with self._lock:
            if register and key not in self._roots and self._disk is not None and not self.readonly:
                name = model_key if isinstance(model_key, str) else model_key.hex()
                self._roots[key] = (key, dict(info or {}, model_key=name, namespace=self.namespace,
                                              created=time.time()))
                try:
                    self._disk.register_model(key, self._roots[key][1])
                except Exception as e:  # a storage fault never reaches the engine; blocks still get stored
                    self._disk_failed("registering a model in", e)
            return self._index.root(key)

    def _child(self, node: Node, key: bytes) -> Optional[Node]:
        """The indexed child of ``node`` with ``key``, looking on disk for
        blocks other processes wrote."""
        child = node.children.get(key) if node.children else None
        if child is None and self._disk is not None and (node.is_root or node.on_disk):
            self._discover(node)
            child = node.children.get(key) if node.children else None
        return child

    def _discover(self, node: Node) -> None:
        try:
            with self._disk.reader() as txn:
                for key in self._disk.children(txn, node.key):
                    if key not in self._index:
                        meta = self._disk.get_meta(txn, key)
                        if meta is not None:
                            self._add_from_meta(node, key, meta)
        except Exception as e:  # a fault on disk is a miss
            self._warn("discover", f"kvstore: reading {self._disk.path} failed: {e}")

    def _add_from_meta(self, parent: Node, key: bytes, meta: dict) -> Optional[Node]:
        try:
            gap = meta.get("g", NO_GAP)
            node = self._index.add(parent, key, meta["s"], meta["n"], meta.get("f", -1), meta.get("sn"), gap,
                                   meta.get("wf", meta["s"] + meta["n"] if gap > 0 else meta["s"]))
        except (KeyError, ValueError):
            return None
        node.on_disk = True
        return node

    def _walk(self, root: Node, chain: KeyChain, n: int) -> tuple[list[Node], int]:
        """Blocks of the longest stored prefix of ``chain.tokens[:n]`` and how
        many tokens they share with it: full blocks by key, then a tail block
        or, at token granularity, a block the prompt diverges inside of."""
        path: list[Node] = []
        node = root
        looked = False  # whether ``_child`` already looked on disk below ``node``
        for i in range(n // self.block_size):
            child = self._child(node, chain.key(i))
            if child is None:
                looked = True
                break
            path.append(child)
            node = child
        matched = node.end if path else 0
        if matched < n:
            # partial blocks other processes wrote below ``node`` are found only on disk, even
            # when this process has children of its own there
            if not looked and self._disk is not None and (node.is_root or node.on_disk):
                self._discover(node)
            best, shared = self._partial(node, chain, matched, n)
            if best is not None:
                path.append(best)
                matched += shared
        return path, matched

    def _partial(self, node: Node, chain: KeyChain, pos: int, n: int) -> tuple[Optional[Node], int]:
        """The child of ``node`` sharing most tokens with the prompt at ``pos``
        (an exact tail block is found by key, others by comparing tokens)."""
        if not node.children:
            return None, 0
        i = pos // self.block_size
        first = int(chain.tokens[pos])
        best, best_len = None, 0
        for child in node.children.values():
            if child.first != first:
                continue
            if child.length <= n - pos and child.key == chain.tail_key(i, child.length):
                shared = child.length
            else:
                shared = self._shared_tokens(child, chain.tokens[pos:n])
            if shared > best_len:
                best, best_len = child, shared
        return best, best_len

    def _shared_tokens(self, node: Node, tokens: np.ndarray) -> int:
        stored = self._tokens_of(node)
        if stored is None:
            return 0
        m = min(len(stored), len(tokens))
        diff = np.flatnonzero(stored[:m] != tokens[:m])
        return int(diff[0]) if diff.size else m

    def _tokens_of(self, node: Node) -> Optional[np.ndarray]:
        block = self._ram.get(node.key)
        if block is not None:
            return block.tokens
        if node.job is not None:
            return node.job.tokens[node.start : node.end]
        if node.on_disk:
            try:
                with self._disk.reader() as txn:
                    meta = self._disk.get_meta(txn, node.key)
                return None if meta is None else np.frombuffer(meta["t"], dtype="<i4")
            except Exception:
                return None
        return None

    def _servable(self, path: list[Node], matched: int) -> int:
        """Longest length <= ``matched`` along ``path`` at which every layer
        can be restored: recurrent state only where a snapshot was taken,
        sliding-window layers only where their window's rows are all there."""
        if not path:
            return 0
        stateful = any(p.snap is not None for p in path)
        ends = {p.end for p in path if p.end <= matched}
        if not stateful:
            ends.add(matched)  # the last block may be used partially: KV trims
        for length in sorted(ends, reverse=True):
            if length and self._restorable(path, length):
                return length
        return 0

    @staticmethod
    def _restorable(path: list[Node], length: int) -> bool:
        for p in path:
            if p.start >= length:
                break
            if p.gap == FULL_GAP:
                return False
            if p.gap > 0 and p.end > length - p.gap and max(p.start, length - p.gap) < p.rows_from:
                return False  # a sliding window reaches rows this block lacks
            if p.snap is not None and p.end == length and not p.snap:
                return False
        last = next(p for p in reversed(path) if p.start < length)
        return last.snap is None or (last.end == length and last.snap)

    # ----------------------------------------------------------------- load

    def _load(self, path: list[Node], toks: np.ndarray, length: int):
        """Payloads of ``path`` checked against the prompt; a bad block cuts the hit."""
        blocks: list[Block] = []
        from_ram: list[bool] = []
        disk_nodes = []
        with self._lock:
            for p in path:
                b = self._ram.get(p.key)
                blocks.append(b)
                from_ram.append(b is not None)
                if b is None:
                    disk_nodes.append(p)
        if disk_nodes and self._disk is not None:  # RAM only: a block dropped while we waited is a miss
            loaded = self._read_disk(disk_nodes)
            blocks = [b if b is not None else loaded.get(p.key) for p, b in zip(path, blocks)]
        good = 0
        for p, b in zip(path, blocks):
            if b is None or not _matches(b, toks, p.start, min(p.end, length)):
                if b is not None:
                    self._bad_block(p, "tokens do not match the prompt (hash collision?)")
                break
            good += 1
        if good < len(path):
            length = min(length, path[good].start)
            length = self._servable(path[:good], length) if good else 0
            path, blocks, from_ram = path[:good], blocks[:good], from_ram[:good]
        with self._lock:
            now = time.time()
            for p, b, r in zip(path, blocks, from_ram):
                if p.start >= length:
                    break
                if r:
                    self._ram.touch(p.key)
                elif p.key in self._index and not p.in_ram:
                    self._promote(p, b)
                if p.on_disk:
                    when, hits = self._uses.get(p.key, (0.0, 0))
                    self._uses[p.key] = (now, hits + 1)
            for p in reversed(path):  # ancestors end up more recent than descendants: LRU evicts leaves
                self._ram.touch(p.key)
        return blocks, length, from_ram

    def _read_disk(self, nodes: list[Node]) -> dict[bytes, Block]:
        out: dict[bytes, Block] = {}
        bad = None
        try:
            with self._disk.reader() as txn:
                for p in nodes:
                    buf = self._disk.get_block(txn, p.key)
                    if buf is None:
                        break
                    try:
                        out[p.key] = deserialize(buf, p.start, key=p.key)
                    except BlockDecodeError as e:
                        bad = (p, str(e))
                        break
        except Exception as e:
            self._warn("read", f"kvstore: reading {self._disk.path} failed: {e}")
        if bad is not None:  # dropped after the read transaction: deleting it from inside could deadlock
            self._bad_block(*bad)  # with a thread waiting to resize the map
        return out

    def _bad_block(self, node: Node, why: str) -> None:
        self._count("corrupt_blocks")
        log.warning("kvstore: block %s (tokens %d-%d) is bad: %s; serving a shorter prefix",
                    node.key.hex()[:16], node.start, node.end, why)
        with self._lock:
            if self._index.get(node.key) is node:
                self._forget(node, from_disk=not self.readonly)

    def _promote(self, node: Node, block: Block) -> None:
        if block.nbytes > self._ram.budget:
            return
        self._make_room(block.nbytes)  # room first: the RAM tier never holds more than its budget
        if self._ram.over(block.nbytes) > 0 or self._index.get(node.key) is not node:
            return  # pinned blocks fill RAM: served without being kept
        self._ram.add(node.key, block)
        node.in_ram = True

    # ---------------------------------------------------------------- evict

    def _make_room(self, extra: int, keep: Optional[Node] = None) -> None:
        """Evict least recently used blocks until ``extra`` more bytes fit."""
        if self._ram.over(extra) <= 0:
            return
        for key in self._ram.lru():
            if self._ram.over(extra) <= 0:
                return
            node = self._index.get(key)
            if node is None:
                self._ram.remove(key)
                continue
            if node.pins or node is keep:
                continue
            self._evict(node)
        if keep is not None and self._ram.over(extra) > 0 and not keep.pins:
            self._evict(keep)

    def _evict(self, node: Node) -> None:
        if not node.on_disk and self._disk is not None and not self.readonly:
            block = self._ram.get(node.key)
            if block is not None and self._write([(node, block)]):
                self._count("sync_writes")
        self._count("evictions_ram")
        if node.on_disk:
            self._ram.remove(node.key)
            node.in_ram = False
        else:
            self._forget(node)

    def _forget(self, node: Node, from_disk: bool = False) -> None:
        """Remove ``node`` and its subtree from the index and RAM (and disk)."""
        dropped = self._index.remove(node)
        for d in dropped:
            self._ram.remove(d.key)
            d.in_ram = False
        if from_disk and self._disk is not None:
            try:
                self._disk.delete([d.key for d in dropped if d.on_disk])
            except Exception as e:
                self._disk_failed("deleting from", e)

    # --------------------------------------------------------- background

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            with self._lock:
                if self._worker is None or not self._worker.is_alive():
                    self._worker = threading.Thread(target=self._work, name="kvstore-writer", daemon=True)
                    self._worker.start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._run_job(job)
                with self._lock:
                    self._pending_bytes -= job.nbytes
            finally:
                self._queue.task_done()

    def _run_job(self, job: _Job) -> None:
        """Encode the job's blocks into the RAM tier and write them through."""
        written: list[tuple[Node, Block]] = []
        pending_bytes = 0
        to_disk = self._disk is not None and not self.readonly
        try:
            for node in job.nodes:
                with self._lock:
                    if self._index.get(node.key) is not node or node.job is not job:
                        continue  # dropped meanwhile (evicted parent, clear) or re-encoded by a later put
                block = _encode(job, node, self.codec)
                with self._lock:
                    if self._index.get(node.key) is not node or node.job is not job:
                        continue
                    if block.nbytes <= self._ram.budget:
                        # room first, so the RAM tier never holds more than its budget, even for a moment;
                        # never from the block's own prefix: a leaf goes before its ancestors
                        ancestors = node.path()[:-1]
                        RadixIndex.pin(ancestors)
                        try:
                            self._make_room(block.nbytes)
                        finally:
                            RadixIndex.unpin(ancestors)
                        if self._index.get(node.key) is not node:
                            continue
                        if self._ram.over(block.nbytes) <= 0:  # else its prefix and pinned blocks fill RAM
                            self._ram.add(node.key, block)
                            node.in_ram = True
                            node.job = None  # servable now; a block bound only for disk keeps its job until written
                            self._touch_ancestors(node)
                    self._count("blocks_stored")
                if to_disk:
                    written.append((node, block))
                    pending_bytes += block.nbytes
                    if pending_bytes >= _WRITE_BATCH:
                        self._write_through(written)
                        written, pending_bytes = [], 0
                with self._lock:
                    if not to_disk and not node.in_ram and self._index.get(node.key) is node:
                        self._forget(node)  # fits in neither tier
                    else:
                        self._make_room(0)
            if written:
                self._write_through(written)
        except Exception:
            log.exception("kvstore: storing %d blocks failed; they are dropped", len(job.nodes))
            with self._lock:
                for node in job.nodes:
                    if self._index.get(node.key) is node and node.job is job and not node.in_ram and not node.on_disk:
                        self._forget(node)
        finally:
            with self._lock:
                for node in job.nodes:
                    if node.job is job:
                        node.job = None
            job.done.set()
            self._save_uses()

    def _write_through(self, items: list[tuple[Node, Block]]) -> None:
        """Write a job's blocks; drop those that then sit in neither tier."""
        self._write(items)
        with self._lock:
            for node, _ in items:
                if self._index.get(node.key) is node and not node.in_ram and not node.on_disk:
                    self._forget(node)  # the write failed and RAM could not hold it

    def _touch_ancestors(self, node: Node) -> None:
        """Make a new block's ancestors more recent than it, so RAM eviction
        takes leaves first (in RAM only, evicting a block drops its subtree)."""
        p = node.parent
        while p is not None and p.in_ram:
            self._ram.touch(p.key)
            p = p.parent

    def _write(self, items: list[tuple[Node, Block]]) -> bool:
        """Write blocks and their metas in one transaction; True when written."""
        now = time.time()
        records = []
        for node, block in items:
            has_state = any(isinstance(l, StateLayer) for l in block.layers)
            if node.on_disk and not has_state:
                continue  # already there (a block re-encoded to add its snapshot is written again)
            payload = serialize(block, node.key)
            kv, dtype = block.describe()
            parent = node.parent.key
            root = node
            while root.parent is not None:
                root = root.parent
            records.append(Record(node.key, parent, {
                "p": parent, "r": root.key, "s": node.start, "n": node.length, "f": node.first,
                "sn": None if node.snap is None else has_state, "g": node.gap, "wf": node.rows_from, "b": len(payload), "t": block.tokens.tobytes(),
                "c": now, "u": now, "h": 0, "kv": kv, "dt": dtype}, payload))
        if not records:
            return False
        if self._full_at is not None and time.monotonic() - self._full_at < _FULL_PAUSE:
            return False  # the device is full and evicting did not help: RAM only for now
        try:
            self._disk.put_records(records)
        except Exception as e:
            self._count("write_errors")
            self._disk_failed("writing to", e)
            if self._disk.is_full(e) and not self._shrink_disk():
                self._full_at = time.monotonic()
            return False
        self._full_at = None
        with self._lock:
            for node, _ in items:
                node.on_disk = True
        self._count("blocks_written", len(records))
        try:
            if self._disk.usage() > self._disk.budget:
                self._evict_disk(int(self._disk.budget * 0.9))
        except Exception as e:  # the blocks are written; staying under budget is retried next write
            self._disk_failed("evicting from", e)
        return True

    def _shrink_disk(self) -> bool:
        """Lower the disk budget below what the full device holds and evict to
        it; False when that failed too."""
        try:
            self._disk.budget = max(0, int(self._disk.usage() * 0.9))
            self._evict_disk(self._disk.budget)
            return True
        except Exception as e:
            self._disk_failed("evicting from", e)
            return False

    def _disk_failed(self, what: str, e: BaseException) -> None:
        """Log a failed LMDB write once per kind; every failure of a full
        device is one kind."""
        if self._disk.is_full(e):
            self._warn("full", f"kvstore: {self._disk.path} is full; keeping new blocks in RAM only "
                               f"and evicting old ones from disk")
        else:
            self._warn(what, f"kvstore: {what} {self._disk.path} failed: {e}")

    def _evict_disk(self, target: int) -> None:
        with self._lock:
            protect = {n.key for n in self._index if n.pins}
        gone = self._disk.evict_to(target, protect)
        if gone:
            log.info("kvstore: evicted %d blocks from %s to stay under its budget", len(gone), self._disk.path)
        with self._lock:
            self._count("evictions_ssd", len(gone))
            for key in gone:
                node = self._index.get(key)
                if node is None:
                    continue
                node.on_disk = False
                if not node.in_ram:
                    self._forget(node)

    def _save_uses(self) -> None:
        """Write last-use times, hit counts and lifetime counters to LMDB."""
        if self._disk is None or self.readonly:
            return
        with self._lock:
            uses, self._uses = self._uses, {}
            counters = {k: v for k, v in self._unsaved.items() if v}
            self._unsaved = dict.fromkeys(_COUNTERS, 0)
        if not uses and not counters:
            return
        try:
            self._disk.touch(uses, counters)
        except Exception as e:
            self._disk_failed("updating use times in", e)

    # ----------------------------------------------------------- start-up

    def _load_index(self) -> None:
        """Rebuild the index from LMDB: every block whose parent chain is whole."""
        roots = {}
        by_parent: dict[bytes, list[tuple[bytes, dict]]] = {}
        bad: list[bytes] = []
        try:
            with self._disk.reader() as txn:
                for key, meta in self._disk.iter_meta(txn, bad):
                    by_parent.setdefault(meta["p"], []).append((key, meta))
                    roots[meta["r"]] = True
        except Exception as e:  # LMDB's own pages are corrupt
            self._disk.close()
            raise StoreOpenError(f"{self._disk.path}: the store's index cannot be read ({e}). It is corrupt: "
                                 f"move it away or delete the directory to start over.") from None
        if bad:
            log.warning("kvstore: %d blocks in %s have an unreadable index record and are ignored "
                        "(`kvstore verify --repair` removes them)", len(bad), self._disk.path)
        loaded = 0
        for r in roots:
            stack = [self._index.root(r)]
            while stack:
                node = stack.pop()
                for key, meta in by_parent.pop(node.key, []):
                    child = self._add_from_meta(node, key, meta)
                    if child is not None:
                        stack.append(child)
                        loaded += 1
        self.orphans = sum(len(v) for v in by_parent.values())
        if self.orphans:
            log.info("kvstore: %d blocks in %s have no parent and are ignored (`kvstore verify --repair` "
                     "removes them)", self.orphans, self._disk.path)

    # ------------------------------------------------------------- helpers

    def _count(self, name: str, k: int = 1) -> None:
        self._counters[name] += k
        self._unsaved[name] += k

    def _warn(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg)

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise RuntimeError("PrefixStore is closed")
        if write and self.readonly:
            raise RuntimeError("PrefixStore was opened read-only")


# ------------------------------------------------------------------ layers


def _check_layers(layers: Sequence[Layer], n: int) -> None:
    if not isinstance(layers, (list, tuple)) or not layers:
        raise LayoutError("layers must be a non-empty list of KVLayer / StateLayer")
    for i, l in enumerate(layers):
        if isinstance(l, KVLayer):
            ks, vs = l.keys.shape, l.values.shape
            if len(ks) != 4 or len(vs) != 4:
                raise LayoutError(f"layer {i}: keys/values must be [batch, heads, tokens, dim], got {ks} and {vs}")
            if ks[0] != 1 or ks[:3] != vs[:3]:
                raise LayoutError(f"layer {i}: keys {ks} and values {vs} must share batch (1), heads and tokens")
            if l.stop != n:
                raise LayoutError(f"layer {i}: rows cover tokens [{l.start}, {l.stop}) but the prompt has {n} tokens")
            if l.start < 0 or l.start > n:
                raise LayoutError(f"layer {i}: start {l.start} outside [0, {n}]")
        elif not isinstance(l, StateLayer):
            raise LayoutError(f"layer {i}: expected KVLayer or StateLayer, got {type(l).__name__}")


def _gap(layers: Sequence[KVLayer], start: int, end: int) -> tuple[int, int]:
    """(``gap``, ``rows_from``) of block ``[start, end)``: see ``index.Node``."""
    gap, rows_from = NO_GAP, start
    for l in layers:
        if l.start > start:
            if l.window is None:
                return FULL_GAP, end
            gap, rows_from = max(gap, l.window), max(rows_from, min(l.start, end))
    return gap, rows_from


def _encode(job: _Job, node: Node, codec: Codec) -> Block:
    s, e = node.start, node.end
    out: list[Optional[Layer]] = []
    for l in job.layers:
        if isinstance(l, KVLayer):
            # a sliding-window layer may hold only the block's last rows
            first = s if l.start <= s else (l.start if l.window is not None and l.start < e else None)
            if first is None:
                out.append(None)
                continue
            k = take_rows(l.keys, first - l.start, e - l.start)
            v = take_rows(l.values, first - l.start, e - l.start)
            out.append(KVLayer(_own(codec.compress_keys(k)), _own(codec.compress_values(v)), first, l.window))
        else:
            out.append(StateLayer([None if a is None else mx.contiguous(a) for a in l.arrays])
                       if e == len(job.tokens) else None)
    block = Block(job.tokens[s:e].copy(), out)
    mx.eval(block_arrays(block))
    return block


def _own(t: Tensor) -> Tensor:
    """A copy that does not keep the engine's whole buffer alive (slices are views)."""
    if isinstance(t, Quantized):
        return t.with_arrays(*(mx.contiguous(a) for a in t.arrays()))
    return mx.contiguous(t)


def _matches(block: Block, toks: np.ndarray, start: int, stop: int) -> bool:
    m = stop - start
    return m <= len(block.tokens) and np.array_equal(block.tokens[:m], toks[start:stop])


def _assemble(blocks: list[Block], length: int, quantized: Optional[tuple[int, int]]) -> list[Layer]:
    """Per layer, the rows of ``[0, length)`` (or of the window) as one tensor."""
    used = [b for b in blocks if b is not None]
    starts = np.cumsum([0] + [len(b.tokens) for b in used])
    out: list[Optional[Layer]] = []
    work = []
    slots = []  # (index in out, first row, window) of each attention layer
    for li, proto in enumerate(used[-1].layers):
        if isinstance(proto, StateLayer) or (proto is None and _is_state_slot(used, li)):
            out.append(proto)
            continue
        window = next((b.layers[li].window for b in used if b.layers[li] is not None), None)
        lo = 0 if window is None else max(0, length - window)
        pieces = []
        for b, s in zip(used, starts):
            e = s + len(b.tokens)
            if e <= lo or s >= length:
                continue
            layer = b.layers[li]
            if layer is None or layer.start > max(lo, s):
                raise BlockDecodeError(f"layer {li} lacks rows its window needs")  # the index said otherwise
            pieces.append((layer, max(lo, s) - layer.start, min(length, e) - layer.start))
        work += [partial(_rows, pieces, "keys", quantized), partial(_rows, pieces, "values", quantized)]
        slots.append((len(out), lo, window))
        out.append(None)
    tensors = spread(work)  # the layers side by side on the CPU's cores
    for (i, lo, window), keys, values in zip(slots, tensors[::2], tensors[1::2]):
        out[i] = KVLayer(keys, values, lo, window)
    return out


def _rows(pieces: list[tuple[KVLayer, int, int]], which: str, quantized: Optional[tuple[int, int]]) -> Tensor:
    """One tensor of the given rows of each block's keys or values."""
    return _concat([take_rows(getattr(layer, which), a, z) for layer, a, z in pieces], quantized)


def _is_state_slot(blocks: list[Block], li: int) -> bool:
    return any(isinstance(b.layers[li], StateLayer) for b in blocks)


def _concat(pieces: list[Tensor], quantized: Optional[tuple[int, int]]) -> Tensor:
    if quantized is not None:
        bits, gs = quantized
        qs = [convert(p, bits, gs) for p in pieces]
        if all(isinstance(q, Quantized) and (q.bits, q.group_size) == (qs[0].bits, qs[0].group_size) for q in qs):
            parts = [mx.concatenate([q.arrays()[i] for q in qs], axis=-2) for i in range(3)]
            return qs[0].with_arrays(*parts)
        pieces = qs  # head dim no group divides: stays dense
    if all(isinstance(p, Quantized) for p in pieces) and len({p.settings for p in pieces}) == 1:
        # dequantize (and unrotate) once over the whole prefix rather than per block
        parts = [mx.concatenate([p.arrays()[i] for p in pieces], axis=-2) for i in range(3)]
        return pieces[0].with_arrays(*parts).dequantize()
    dense = [p.dequantize() if isinstance(p, Quantized) else p for p in pieces]
    return dense[0] if len(dense) == 1 else mx.concatenate(dense, axis=-2)


def _join(q: queue.Queue, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while q.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)


_OPEN: "weakref.WeakSet[PrefixStore]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Interpreter exit flushes what is still queued (close() does the same)."""
    for store in list(_OPEN):
        try:
            store.close()
        except Exception:
            log.exception("kvstore: closing a store at exit failed")
