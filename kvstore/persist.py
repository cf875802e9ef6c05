"""The store's side of its persistent tier: what is on disk, writing batches,
staying under the disk budget, a full device, the index rebuilt at open.

Disk I/O never runs under the store lock: methods read or write first and
take the lock only to update the index (``*_locked`` methods are called with
it held and do no I/O).

Disk eviction is leaf-first LRU kept incrementally: a heap of blocks on disk
with no child on disk, ordered by last use, with stale entries skipped as they
surface. Evicting one block costs O(log n) however many blocks the store holds.
Blocks other processes wrote are in it once this process has seen them (at
open, or found by a lookup); each process evicts what it knows.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence

from .counters import Counters
from .errors import StoreOpenError
from .index import Node, RadixIndex
from .record import BlockRecord
from .tiers.base import Entry
from .tiers.lmdb import LmdbTier

log = logging.getLogger("kvstore")

_FULL_PAUSE = 30.0  # seconds without disk writes after the device filled up and evicting could not help
_EVICT_ROUNDS = 64


class Persist:
    def __init__(self, disk: LmdbTier, index: RadixIndex, lock, counters: Counters,
                 warn: Callable[[str, str], None]):
        self.disk = disk
        self.index = index
        self.lock = lock
        self.counters = counters
        self.warn = warn
        self.blocks = 0  # indexed blocks with a disk copy
        self.orphans = 0
        self._lru: list[tuple[float, int, Node]] = []  # (last use, tie-break, node): disk leaves, lazily
        self._seq = itertools.count()
        self._full_at: Optional[float] = None  # when a full device last stopped writes to it

    # ------------------------------------------------------- on-disk state

    def mark_locked(self, node: Node, on_disk: bool) -> None:
        """Set ``node.on_disk``, keeping leaf counts and the LRU heap."""
        if node.on_disk == on_disk:
            return
        node.on_disk = on_disk
        parent = node.parent
        if on_disk:
            self.blocks += 1
            if parent is not None and not parent.is_root:
                parent.disk_kids += 1
            self._push(node)
        else:
            self.blocks -= 1
            if parent is not None and not parent.is_root:
                parent.disk_kids -= 1
                self._push(parent)

    def removed_locked(self, dropped: Sequence[Node]) -> None:
        """Nodes left the index (a subtree: ``dropped[0]`` is its top)."""
        for d in dropped:
            if d.on_disk:
                self.blocks -= 1
        top = dropped[0] if dropped else None
        if top is not None and top.on_disk and top.parent is not None and not top.parent.is_root:
            top.parent.disk_kids -= 1
            self._push(top.parent)

    def used_locked(self, node: Node, when: float) -> None:
        node.used = when
        self._push(node)

    def _push(self, node: Node) -> None:
        if node.on_disk and node.disk_kids == 0:
            heapq.heappush(self._lru, (node.used, next(self._seq), node))
            if len(self._lru) > 2 * self.blocks + 1024:
                self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (every use pushes one): amortized O(1) per push."""
        live = {}
        for used, seq, node in self._lru:
            if (used == node.used and node.on_disk and not node.disk_kids
                    and self.index.get(node.key) is node):
                live[id(node)] = (used, seq, node)
        self._lru = list(live.values())
        heapq.heapify(self._lru)

    def _pop_victims_locked(self, nbytes: int) -> list[Node]:
        """Least recently used disk leaves, unpinned, about ``nbytes`` of them."""
        out, held, freed, seen = [], [], 0, set()
        while self._lru and freed < nbytes:
            used, _, node = heapq.heappop(self._lru)
            if (self.index.get(node.key) is not node or not node.on_disk or node.disk_kids
                    or used != node.used or id(node) in seen):
                continue  # stale entry
            seen.add(id(node))
            if node.pins:
                held.append(node)
                continue
            out.append(node)
            freed += max(node.nbytes, 1)
        for node in held:
            self._push(node)
        return out

    # ------------------------------------------------------------- writes

    def write(self, entries: Iterable[tuple[Node, Entry]], nbytes: Optional[int] = None) -> bool:
        """Write blocks and their records in one transaction; True when written.
        ``entries`` may be a stream (``nbytes``: about its total), copied as it
        comes; it is taken to its end whether written or not. Takes the lock
        itself (only after the write)."""
        source = iter(entries)
        first = next(source, None)
        if first is None:
            return False
        pairs: list[tuple[Node, Entry]] = []

        def taken() -> Iterator[Entry]:
            for pair in itertools.chain((first,), source):
                pairs.append(pair)
                yield pair[1]

        if self._full_at is not None and time.monotonic() - self._full_at < _FULL_PAUSE:
            for _ in source:
                pass
            return False  # the device is full and evicting did not help: RAM only for now
        try:
            self.disk.store(taken(), nbytes)
        except Exception as e:
            for _ in source:
                pass
            self.counters.count("write_errors")
            self.failed("writing to", e)
            if self.disk.is_full(e) and not self._shrink():
                self._full_at = time.monotonic()
            return False
        self._full_at = None
        with self.lock:
            for node, e in pairs:
                node.nbytes = len(e.payload)
                node.used = e.record.used
                node.offset = e.record.offset
                self.mark_locked(node, True)
        self.counters.count("blocks_written", len(pairs))
        try:
            if self.disk.usage() > self.disk.budget:
                self.evict_to(int(self.disk.budget * 0.9))
        except Exception as e:  # the blocks are written; staying under budget is retried next write
            self.failed("evicting from", e)
        return True

    def evict_to(self, target: int) -> int:
        """Delete least recently used disk leaves until usage <= ``target``;
        a block then in no tier leaves the index."""
        gone = 0
        for _ in range(_EVICT_ROUNDS):
            over = self.disk.usage() - target
            if over <= 0:
                break
            with self.lock:
                victims = self._pop_victims_locked(over)
            if not victims:
                break
            deleted = set(self.disk.remove([v.key for v in victims]))
            with self.lock:
                for v in victims:
                    if self.index.get(v.key) is not v:
                        continue
                    if v.key not in deleted and v.on_disk:
                        self._push(v)  # another process removed it first, or it survived: keep it known
                        continue
                    self.mark_locked(v, False)
                    if not v.in_ram and v.job is None and self.forget is not None:
                        self.forget(v)
            gone += len(deleted)
        if gone:
            self.counters.count("evictions_ssd", gone)
            log.info("kvstore: evicted %d blocks from %s to stay under its budget", gone, self.disk.path)
        return gone

    forget: Optional[Callable[[Node], None]] = None  # set by the store: drop a node in no tier (lock held)

    def _shrink(self) -> bool:
        """Lower the disk budget below what the full device holds and evict to
        it; False when that failed too."""
        try:
            self.disk.budget = max(0, int(self.disk.usage() * 0.9))
            self.evict_to(self.disk.budget)
            return True
        except Exception as e:
            self.failed("evicting from", e)
            return False

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            try:
                self.disk.remove(keys)
            except Exception as e:
                self.failed("deleting from", e)

    def save(self) -> None:
        """Write last-use times, hit counts and lifetime counters."""
        uses, deltas = self.counters.drain()
        if not uses and not deltas:
            return
        try:
            self.disk.touch(uses)
            self.disk.add_counters(deltas)
        except Exception as e:
            self.counters.restore(uses, deltas)
            self.failed("updating use times in", e)

    def register_model(self, root: bytes, info: dict) -> None:
        try:
            self.disk.register_model(root, info)
        except Exception as e:  # a storage fault never reaches the engine; blocks still get stored
            self.failed("registering a model in", e)

    def failed(self, what: str, e: BaseException) -> None:
        """Log a failed disk operation once per kind; every failure of a full
        device is one kind."""
        if self.disk.is_full(e):
            self.warn("full", f"kvstore: {self.disk.path} is full; keeping new blocks in RAM only "
                              f"and evicting old ones from disk")
        else:
            self.warn(what, f"kvstore: {what} {self.disk.path} failed: {e}")

    # -------------------------------------------------------------- reads

    def adopt_locked(self, parent: Node, rec: BlockRecord) -> Optional[Node]:
        """Index a block found on disk under ``parent``."""
        if rec.parent != parent.key:
            return None
        try:
            node = self.index.add(parent, rec.key, rec.start, rec.length, rec.first, rec.snap, rec.gap,
                                  rec.first_row if rec.gap else None)
        except (KeyError, ValueError):
            return None
        node.nbytes, node.used, node.offset = rec.nbytes, max(node.used, rec.used), rec.offset
        self.mark_locked(node, True)
        return node

    def discover(self, node: Node) -> None:
        """Index the blocks other processes wrote below ``node``."""
        found: list[BlockRecord] = []
        try:
            with self.disk.reader() as txn:
                for key in self.disk.children(txn, node.key):
                    if key not in self.index:
                        rec = self.disk.record(txn, key)
                        if rec is not None:
                            found.append(rec)
        except Exception as e:  # a fault on disk is a miss
            self.warn("discover", f"kvstore: reading {self.disk.path} failed: {e}")
        if found:
            with self.lock:
                if node.is_root or self.index.get(node.key) is node:
                    for rec in found:
                        self.adopt_locked(node, rec)

    def tokens(self, node: Node):
        """A block's stored tokens from its record (``None`` when unreadable)."""
        try:
            with self.disk.reader() as txn:
                rec = self.disk.record(txn, node.key)
            return None if rec is None else rec.tokens
        except Exception:
            return None

    def load_index(self, root_of: Callable[[bytes], Node]) -> None:
        """Rebuild the index from disk: every block whose parent chain is whole."""
        roots: set[bytes] = set()
        by_parent: dict[bytes, list[BlockRecord]] = {}
        bad: list[bytes] = []
        try:
            with self.disk.reader() as txn:
                for rec in self.disk.records(txn, bad):
                    by_parent.setdefault(rec.parent, []).append(rec)
                    roots.add(rec.root)
        except Exception as e:  # LMDB's own pages are corrupt
            self.disk.close()
            raise StoreOpenError(f"{self.disk.path}: the store's index cannot be read ({e}). It is corrupt: "
                                 f"move it away or delete the directory to start over.") from None
        if bad:
            log.warning("kvstore: %d blocks in %s have an unreadable index record and are ignored "
                        "(`kvstore verify --repair` removes them)", len(bad), self.disk.path)
        with self.lock:
            for r in roots:
                stack = [root_of(r)]
                while stack:
                    node = stack.pop()
                    for rec in by_parent.pop(node.key, []):
                        child = self.adopt_locked(node, rec)
                        if child is not None:
                            stack.append(child)
        self.orphans = sum(len(v) for v in by_parent.values())
        if self.orphans:
            log.info("kvstore: %d blocks in %s have no parent and are ignored (`kvstore verify --repair` "
                     "removes them)", self.orphans, self.disk.path)
