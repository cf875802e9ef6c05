"""Where blocks live in RAM: admission after encoding, promotion after a
disk read, LRU eviction, forgetting a subtree; and loading a path's blocks
from the tiers for a fetch.

RAM eviction takes leaves first without a scan: ancestors are always touched
after their descendants, so the least recently used end of the RAM tier's
order holds leaves, and eviction walks from there, skipping only blocks
pinned by a reader in flight. A block evicted before its disk write finished
stays in the index: the background writer still holds it and writes it.

``*_locked`` methods are called with the store lock held and do no disk I/O;
``load`` takes the lock itself around its in-memory steps.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .wire import Stored
from .gather import gather
from .counters import Counters
from .index import Node, RadixIndex
from .lookup import servable
from .persist import Persist
from .tiers.base import Use
from .tiers.ram import RamTier

log = logging.getLogger("kvstore")


class Placement:
    def __init__(self, index: RadixIndex, ram: RamTier, persist: Optional[Persist], lock, counters: Counters,
                 writable: bool):
        self.index = index
        self.ram = ram
        self.persist = persist
        self.lock = lock
        self.counters = counters
        self.writable = writable
        self._promoting: dict = {}  # key -> future of its pending promotion
        self._promote_pool = None
        self._promote_pid = os.getpid()
        if persist is not None:
            persist.forget = self.forget_locked

    # ----------------------------------------------------------------- RAM

    def admit_locked(self, node: Node, block: Stored) -> bool:
        """Keep a freshly encoded block in RAM when it fits; True when kept.
        Room is made first, never from the block's own prefix (a leaf goes
        before its ancestors), so RAM never holds more than its budget."""
        if block.nbytes > self.ram.budget:
            return False
        ancestors = node.path()[:-1]
        RadixIndex.pin(ancestors)
        try:
            self.make_room_locked(block.nbytes)
        finally:
            RadixIndex.unpin(ancestors)
        if self.index.get(node.key) is not node or self.ram.over(block.nbytes) > 0:
            return False  # dropped meanwhile, or its prefix and pinned blocks fill RAM
        self.ram.add(node.key, block)
        node.in_ram = True
        self.ram.touch({p.key: None for p in reversed(ancestors) if p.in_ram})  # leaves stay the oldest
        return True

    def promote_locked(self, node: Node, block: Stored) -> None:
        """Keep a block read from disk in RAM, if it fits beside pinned ones."""
        if block.nbytes > self.ram.budget or self.index.get(node.key) is not node:
            return
        self.make_room_locked(block.nbytes)
        if self.ram.over(block.nbytes) <= 0:
            self.ram.add(node.key, block)
            node.in_ram = True

    def make_room_locked(self, extra: int, keep: Optional[Node] = None) -> None:
        """Evict least recently used blocks until ``extra`` more bytes fit."""
        need = self.ram.over(extra)
        if need <= 0:
            return
        victims: list[tuple[bytes, Optional[Node]]] = []
        freed = 0
        for key, block in self.ram.oldest():
            node = self.index.get(key)
            if node is not None and (node.pins or node is keep):
                continue
            victims.append((key, node))
            freed += block.nbytes
            if freed >= need:
                break
        for key, node in victims:
            if self.ram.over(extra) <= 0:
                return
            if node is None:
                self.ram.pop(key)
            elif node.in_ram:  # not dropped with an evicted ancestor's subtree meanwhile
                self.evict_locked(node)
        if keep is not None and self.ram.over(extra) > 0 and not keep.pins:
            self.evict_locked(keep)

    def evict_locked(self, node: Node) -> None:
        self.counters.count("evictions_ram")
        unwritten = node.job is not None and not node.on_disk and self.persist is not None and self.writable
        if node.on_disk or unwritten:
            if unwritten:
                self.counters.count("evicted_unwritten")
            self.ram.pop(node.key)
            node.in_ram = False
        else:
            self.forget_locked(node)

    def forget_locked(self, node: Node) -> list[bytes]:
        """Remove ``node`` and its subtree from the index and RAM; returns the
        keys of those with a disk copy (for the caller to delete, unlocked)."""
        dropped = self.index.remove(node)
        for d in dropped:
            self.ram.pop(d.key)
            d.in_ram = False
        if self.persist is not None:
            self.persist.removed_locked(dropped)
        return [d.key for d in dropped if d.on_disk]

    # ---------------------------------------------------------------- load

    def tokens_of(self, node: Node) -> Optional[np.ndarray]:
        """A block's stored tokens, from wherever it is (no lock needed)."""
        block = self.ram.get(node.key)
        if block is not None:
            return block.tokens
        job = node.job
        if job is not None:
            return job.tokens[node.start : node.end]
        if node.on_disk and self.persist is not None:
            return self.persist.tokens(node)
        return None

    def load(self, path: list[Node], toks: np.ndarray, length: int,
             quantized: Optional[tuple[int, int]] = None, cold: frozenset = frozenset()) -> "Served":
        """The layers of ``path``'s blocks for ``[0, length)``, checked against
        the prompt; a bad block cuts the hit (and leaves the store). Disk blocks
        are read and assembled inside one read transaction, straight from the
        mapped pages (``gather``), and promoted to RAM afterwards, off the
        caller's path. ``cold``: keys of disk blocks the cost plan found out
        of the page cache (read ahead). Called unlocked with ``path`` pinned."""
        self.wait_promotions([p.key for p in path])
        with self.lock:
            items: list = [self.ram.get(p.key) for p in path]
        from_ram = [b is not None for b in items]
        bad: list[tuple[Node, str]] = []  # dropped after the read transaction: no write inside one
        gone: list[Node] = []
        if all(from_ram) or self.persist is None:
            served = self._serve(path, items, from_ram, toks, length, quantized, bad)
        else:
            ahead: list[Future] = []
            try:
                disk = self.persist.disk
                ahead = self._read_ahead([p.key for p, it in zip(path, items) if it is None and p.key in cold])
                with disk.reader() as txn:
                    for i, p in enumerate(path):
                        if items[i] is None:
                            got = disk.stored(txn, p.key, p.start, unread=True)  # read while copied
                            if isinstance(got, str):
                                bad.append((p, got))
                                break
                            if got is None:  # removed by another process (`kvstore clear`, its eviction)
                                gone.append(p)
                                break
                            if p.offset < 0:  # learnt for the residency check (blocks written before offsets)
                                p.offset = disk.offset_of(got.buf)
                            items[i] = got
                    served = self._serve(path, items, from_ram, toks, length, quantized, bad)
            except Exception as e:
                self.persist.warn("read", f"kvstore: reading {self.persist.disk.path} failed: {e}")
                k = next((i for i, r in enumerate(from_ram) if not r), len(path))
                served = self._serve(path[:k], items[:k], from_ram[:k], toks, length, quantized, bad)
            finally:
                wait(ahead)  # (outside the read transaction: a read-ahead may wait on a resize that waits on it)
        for p, why in bad:
            self._drop_bad(p, why)
        for p in gone:
            self._forget_gone(p)
        self.promote_later([p for p, r in zip(path, served.from_ram) if not r])
        return served

    def _read_ahead(self, cold: list[bytes]) -> list[Future]:
        """Read the blocks known to be cold on several threads while the
        hit's transaction copies them in order (a cached block is left alone:
        touching its pages again costs time)."""
        return self.persist.disk.read_ahead(cold) if len(cold) > 1 else []

    def _serve(self, path, items, from_ram, toks, length, quantized, bad: list) -> "Served":
        """Cut at the first missing or foreign block, gather, and retry
        shorter when a payload fails its checksum."""
        good = 0
        for p, it in zip(path, items):
            if it is None:
                break
            if not _matches(it, toks, p.start, min(p.end, length)):
                bad.append((p, "tokens do not match the prompt (hash collision?)"))
                break
            good += 1
        while True:
            if good < len(path):
                path, items, from_ram = path[:good], items[:good], from_ram[:good]
                length = servable(path, min(length, path[-1].end)) if path else 0
            if length == 0:
                return Served([], 0, [], [])
            path_used = [p for p in path if p.start < length]
            k = len(path_used)
            try:
                got = gather(items[:k], length, quantized)
            except Exception as e:  # blocks that do not fit together (a reused model key, a bad index record)
                log.warning("kvstore: stored blocks for this prompt do not fit together (%s); serving a miss", e)
                return Served([], 0, [], [])
            if got.bad is None:
                break
            bad.append((path_used[got.bad], "payload checksum mismatch"))
            good = got.bad
        now = time.time()
        with self.lock:
            for p in path_used:
                if p.on_disk and self.persist is not None:
                    self.persist.used_locked(p, now)
            # ancestors end up more recent than descendants: eviction takes leaves first
            self.ram.touch({p.key: Use(now) for p in reversed(path_used)})
        self.counters.used([p for p in path_used if p.on_disk], now)
        return Served(got.layers, got.length, from_ram[:k], [it.nbytes for it in items[:k]])

    # ----------------------------------------------------------- promotion

    def promote_later(self, nodes: list[Node]) -> None:
        """Copy blocks just served from disk into RAM on a thread of its own:
        the hit that read them does not wait for the copies."""
        nodes = [p for p in nodes if p.on_disk and p.nbytes <= self.ram.budget]
        if not nodes or self.persist is None:
            return
        fut = self._promoter().submit(self._promote, nodes)
        with self.lock:
            for p in nodes:
                self._promoting[p.key] = fut

    def settle(self) -> None:
        """Wait for every promotion started so far."""
        with self.lock:
            futs = {id(f): f for f in self._promoting.values()}
        for f in futs.values():
            f.result()

    def wait_promotions(self, keys: list[bytes]) -> None:
        with self.lock:
            futs = {id(f): f for k in keys if (f := self._promoting.get(k)) is not None}
        for f in futs.values():
            f.result()

    def _promoter(self):
        if self._promote_pool is None or self._promote_pid != os.getpid():  # (a forked child: the thread is not here)
            self._promote_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-promote")
            self._promote_pid = os.getpid()
        return self._promote_pool

    def _promote(self, nodes: list[Node]) -> None:
        try:
            held: list[Stored] = []
            disk = self.persist.disk
            with disk.reader() as txn:  # one copy of each value out of the map (checked), no decode
                for p in nodes:
                    got = disk.stored(txn, p.key, p.start)
                    got = got.held() if isinstance(got, Stored) else None
                    if got is None:
                        break
                    held.append(got)
            with self.lock:
                for p, b in zip(nodes, held):
                    if self.index.get(p.key) is p and not p.in_ram:
                        self.promote_locked(p, b)
                self.make_room_locked(0)
        except Exception as e:  # a cache: a failed promotion only means the next hit reads the disk again
            log.debug("kvstore: promotion failed: %s", e)
        finally:
            with self.lock:
                for p in nodes:
                    self._promoting.pop(p.key, None)

    def close(self) -> None:
        if self._promote_pool is not None:
            self._promote_pool.shutdown(wait=True)
            self._promote_pool = None

    def _forget_gone(self, node: Node) -> None:
        """A block the index has on disk that is no longer there leaves the
        index with the blocks under it: a later put stores them again (they
        stayed indexed: puts stored nothing, fetches missed until a restart)."""
        self.counters.count("blocks_gone")
        with self.lock:
            if self.index.get(node.key) is node and not node.in_ram and node.job is None:
                self.forget_locked(node)

    def _drop_bad(self, node: Node, why: str) -> None:
        self.counters.count("corrupt_blocks")
        log.warning("kvstore: block %s (tokens %d-%d) is bad: %s; serving a shorter prefix",
                    node.key.hex()[:16], node.start, node.end, why)
        with self.lock:
            keys = self.forget_locked(node) if self.index.get(node.key) is node else []
        if self.writable and self.persist is not None:
            self.persist.delete(keys)


def _matches(item, toks: np.ndarray, start: int, stop: int) -> bool:
    tokens = item.tokens
    m = stop - start
    return m <= len(tokens) and np.array_equal(tokens[:m], toks[start:stop])


@dataclass
class Served:
    """What ``load`` served: layers of ``[0, length)``, and per block used,
    whether it came from RAM and its stored bytes."""

    layers: list
    length: int
    from_ram: list[bool]
    nbytes: list[int]
