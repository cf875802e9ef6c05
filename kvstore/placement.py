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
import time
from typing import Optional

import numpy as np

from .codec import Block
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
        if persist is not None:
            persist.forget = self.forget_locked

    # ----------------------------------------------------------------- RAM

    def admit_locked(self, node: Node, block: Block) -> bool:
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

    def promote_locked(self, node: Node, block: Block) -> None:
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

    def load(self, path: list[Node], toks: np.ndarray, length: int) -> tuple[list[Block], int, list[bool]]:
        """Blocks of ``path`` checked against the prompt; a bad block cuts the
        hit (and leaves the store). Returns blocks, servable length, and which
        blocks came from RAM. Called unlocked with ``path`` pinned."""
        wanted = [(p.key, p.start) for p in path]
        with self.lock:
            blocks: list[Optional[Block]] = [self.ram.get(k) for k, _ in wanted]
        from_ram = [b is not None for b in blocks]
        bad: dict[bytes, str] = {}
        missing = [w for w, b in zip(wanted, blocks) if b is None]
        if missing and self.persist is not None:  # RAM only: a block dropped while we waited is a miss
            try:
                loaded = self.persist.disk.load(missing)
                bad.update(loaded.bad)
                blocks = [b if b is not None else loaded.blocks.get(k) for (k, _), b in zip(wanted, blocks)]
            except Exception as e:
                self.persist.warn("read", f"kvstore: reading {self.persist.disk.path} failed: {e}")
        good = 0
        for p, b in zip(path, blocks):
            if b is None or not _matches(b, toks, p.start, min(p.end, length)):
                if b is not None:
                    bad[p.key] = "tokens do not match the prompt (hash collision?)"
                break
            good += 1
        for p in path:
            if p.key in bad:
                self._drop_bad(p, bad[p.key])
        if good < len(path):
            length = min(length, path[good].start)
            path, blocks, from_ram = path[:good], blocks[:good], from_ram[:good]
            length = servable(path, length) if path else 0
        served = [p for p in path if p.start < length]
        now = time.time()
        with self.lock:
            for p, b, r in zip(served, blocks, from_ram):
                if not r and self.index.get(p.key) is p and not p.in_ram:
                    self.promote_locked(p, b)
                if p.on_disk and self.persist is not None:
                    self.persist.used_locked(p, now)
            # ancestors end up more recent than descendants: eviction takes leaves first
            self.ram.touch({p.key: Use(now) for p in reversed(served)})
        self.counters.used([p for p in served if p.on_disk], now)
        return blocks, length, from_ram

    def _drop_bad(self, node: Node, why: str) -> None:
        self.counters.count("corrupt_blocks")
        log.warning("kvstore: block %s (tokens %d-%d) is bad: %s; serving a shorter prefix",
                    node.key.hex()[:16], node.start, node.end, why)
        with self.lock:
            keys = self.forget_locked(node) if self.index.get(node.key) is node else []
        if self.writable and self.persist is not None:
            self.persist.delete(keys)


def _matches(block: Block, toks: np.ndarray, start: int, stop: int) -> bool:
    m = stop - start
    return m <= len(block.tokens) and np.array_equal(block.tokens[:m], toks[start:stop])
