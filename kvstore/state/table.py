"""BlockTable: which blocks the store knows, where each one lives, and the one lock over all of it.

A block is a ``Node`` of the radix index, and nodes never leave the table: it hands out ``BlockRef``s (immutable:
which block, where it sits, where it was when handed out) and takes them back to act on the blocks, ignoring a ref
to a block dropped meanwhile. The table alone changes nodes and the places that hold them: the RAM and device tiers'
bytes and LRU order, the disk tier's LRU of leaves, pins of readers in flight, and the id of the put that has not
yet made a block durable (the writer owns the put). Every method takes the lock itself and does no I/O, so the read,
write, discovery and costing paths are siblings that ask the table, never each other. Lock order: a thread may hold
an LMDB transaction (the tier's gate) when it calls the table, never the other way round.

Eviction takes leaves first, without a scan, in both tiers:

- RAM: ancestors are touched after their descendants, so the least recently used end of the RAM order holds leaves;
  eviction walks from there, skipping pinned blocks. A block evicted before its disk write finished stays indexed
  (the writer holds it and writes it).
- Disk: a heap of blocks on disk with no child on disk, by last use (``DiskOrder``): O(log n) per evicted block.

Two parts made here with the index and the lock own the rest: ``disk`` (``DiskSide``: blocks on disk, their LRU,
adoption) and ``admissions`` (``ssd_admit="reuse"``'s queue); ``Gone`` remembers why blocks left.
"""

from __future__ import annotations

import threading
from itertools import repeat
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from . import lookup
from ..blocks.wire import Stored
from ..counters import Counters
from .table_admit import Admissions
from .table_device import DeviceSide
from .table_disk import DiskSide
from .gone import Gone
from ..blocks.hashing import KeyChain
from .index import BlockRef, Node, RadixIndex
from .plans import Candidate, Lookup, Pinned, Placed, Touched
from ..blocks.layers import KVLayer
from ..blocks.record import BlockRecord
from ..tiers.ram import RamTier


class BlockTable:
    def __init__(self, ram_budget: int, counters: Counters, *, has_disk: bool, writable: bool,
                 device_budget: int = 0, admit_on_reuse: bool = False):
        self._lock = threading.RLock()
        self._index = RadixIndex()
        self._ram = RamTier(ram_budget)
        self._counters = counters
        self._has_disk, self._writable, self._on_device = has_disk, writable, device_budget > 0
        self._new: dict[int, list[Node]] = {}  # a put's new blocks until the writer takes their refs
        self._gone = Gone()  # why blocks left the index (a later miss on them is told)
        self.disk = DiskSide(self._index, self._lock, self._forget)
        self.device = DeviceSide(self._index, self._lock, device_budget, has_disk, self._promote, self._forget)
        self.admissions = Admissions(self._index, self._lock, self._ram.get, admit_on_reuse and has_disk and writable)

    # ---------------------------------------------------------------- reads

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    @property
    def leaves(self) -> int:
        return self._index.leaves

    servable = staticmethod(lookup.servable)

    def in_ram(self, refs: Sequence[BlockRef]) -> list[bool]:
        with self._lock:
            return [n is not None and n.in_ram for n in map(self._index.node, refs)]

    def on_disk(self, ref: BlockRef, parent: bool = False) -> bool:
        """Whether the block (or, ``parent``, its parent) has a disk copy now."""
        with self._lock:
            node = self._index.node(ref)
            return (node := node.parent if parent and node is not None else node) is not None and node.on_disk

    def keys_held(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """The keys of the blocks in RAM (least recently used first) and in the device tier, at one moment."""
        with self._lock:
            return tuple(k for k, _ in self._ram.oldest()), self.device.keys()

    def held(self, key: bytes) -> Optional[Stored]:
        """A block's bytes in RAM (a dict read: no lock needed)."""
        return self._ram.get(key)

    @property
    def device_budget(self) -> int:
        return self.device.budget

    def stats(self) -> dict:
        with self._lock:
            return dict(ram_bytes=self._ram.nbytes, ram_blocks=len(self._ram), ram_budget=self._ram.budget,
                        **self.device.stats(),
                        blocks_indexed=len(self._index))

    @property
    def ram_bytes(self) -> int:
        return self._ram.nbytes

    @property
    def ram_budget(self) -> int:
        return self._ram.budget

    # ------------------------------------------------------------------ put

    def plan_put(self, root_key: bytes, chain: KeyChain, n: int, has_state: bool, late: Sequence[KVLayer],
                 pending: Callable[[int], int]) -> int:
        """Index the blocks of a put the store lacks; ``pending(count)`` gives them the writer's id of their put
        (registered there first: a fetch that finds the id can wait for it). Returns that id, 0 when nothing is
        new. Their refs are made on the writer's thread (``new_refs``), not here."""
        with self._lock:
            root = self._index.root(root_key)
            new = lookup.new_blocks(self._index, root, chain, n, has_state, late)
            if self.admissions.on:
                self.admissions.shared(new, lambda: lookup.walk(self._index, root, chain, n).last, chain.block_size)
            if not new:
                return 0
            pid = pending(len(new))
            for node in new:
                node.pending = pid
            self._new[pid] = new
            return pid

    def hand_over(self, older: Sequence[int], pending: int) -> list[int]:
        """The blocks of queued puts ``older`` the writer has not taken yet become the put ``pending``'s (whose
        arrays hold their rows too: a longer prompt of the same prefix); returns the ids handed over."""
        with self._lock:
            moved = [o for o in older if o in self._new]
            nodes = [n for o in moved for n in self._new.pop(o)]
            for n in nodes:
                if n.pending in moved:
                    n.pending = pending
            self._new[pending] = sorted(nodes + self._new.get(pending, []), key=lambda n: n.start)
            return moved

    def new_refs(self, pending: int) -> list[BlockRef]:
        """The refs of the blocks ``plan_put`` indexed for the put ``pending`` (once: the writer takes them)."""
        with self._lock:
            return [n.ref() for n in self._new.pop(pending, ())]

    def encoded(self, ref: BlockRef, pending: int, block: Stored, ram_only: bool,
                record: Optional[BlockRecord] = None) -> Placed:
        """A freshly encoded block of the put ``pending``: kept in RAM when it
        fits (room made first, never from its own prefix). For a RAM-only
        store that is where it is durable; one that fits nowhere leaves the
        index. Kept in RAM only, with ``record``, until it is asked for again
        under ``ssd_admit="reuse"``."""
        pid = pending
        with self._lock:
            node = self._index.node(ref)
            if node is None or node.pending != pid:
                return Placed.NOT_KEPT
            kept = self._admit(node, block)
            wait = not ram_only and not self.admissions.to_disk(node, pid)
            if ram_only or wait:
                if not kept:
                    self._forget(node)
                    return Placed.NOT_KEPT
                node.pending = 0
                if wait:
                    node.record = record
                    return Placed.RAM_ONLY
            return Placed.TO_DISK

    def is_pending(self, ref: BlockRef, pending: int) -> bool:
        """Whether the block is still indexed and the put ``pending``'s to
        store (not dropped meanwhile, nor re-encoded by a later put)."""
        with self._lock:
            node = self._index.node(ref)
            return node is not None and node.pending == pending

    def put_done(self, pending: int, refs: Sequence[BlockRef], dropped: bool = False) -> None:
        """The put ``pending`` is finished with ``refs`` (its write done, or,
        ``dropped``, failed): a block in no tier leaves the index (a later put
        stores it again)."""
        pid = pending
        with self._lock:
            for node in self._index.nodes(refs):
                if dropped and node.pending != pid:
                    continue
                if node.pending == pid:
                    node.pending = 0
                if not node.held:
                    self._forget(node, "skipped" if dropped else "evicted")

    def put_released(self, pending: int, refs: Sequence[BlockRef]) -> None:
        """The put ``pending`` no longer holds these blocks (a fetch need not wait for it)."""
        with self._lock:
            self._new.pop(pending, None)
            for node in self._index.nodes(refs):
                if node.pending == pending:
                    node.pending = 0

    # ---------------------------------------------------------------- fetch
    # A fetch asks three times: ``lookup`` (what is indexed along the prompt), ``pin`` (the servable path held
    # in place, and where each block is), then ``served`` (what it used) or ``release`` (nothing served).

    def lookup(self, root: bytes, chain: KeyChain, n: int) -> Lookup:
        """The longest run of the prompt's whole blocks indexed below the root key ``root``, and the blocks
        below its last one that ``chain.tokens[:n]`` may end or diverge inside of (tokens in RAM handed over)."""
        with self._lock:
            w = lookup.walk(self._index, self._index.root(root), chain, n)
            stop = w.last
            cands = [Candidate(c.ref(), self._tokens_held(c), c.pending)
                     for c in lookup.partial_candidates(stop, chain, w.length, n)]
            return Lookup(stop.ref(), RadixIndex.refs(w.nodes), cands)

    def missing(self, keys: Sequence[bytes], root: bytes) -> tuple[list[Optional[str]], list[bytes]]:
        """Why each of ``keys`` (blocks no tier holds) left the index, where this process knows (``None``:
        never held here, or forgotten), and the other roots (models) the table holds blocks of."""
        with self._lock:
            return self._gone.why(keys), [r.key for r in self._index.roots() if r.key != root and r.children]

    def _tokens_held(self, node: Node) -> Optional[np.ndarray]:
        block = self._ram.get(node.key) if node.in_ram else None
        return self.device.tokens(node) if block is None else block.tokens

    def pin(self, path: Sequence[BlockRef], matched: int, found: Mapping[bytes, Stored] = {}) -> Pinned:
        """The blocks of ``path`` that serve a prefix (of at most ``matched`` tokens), pinned, with the
        pending puts a fetch of them waits for (leaving out blocks in ``found``, in hand already) and where
        each block is now. Hand it back to ``served`` or ``release``."""
        length = lookup.servable(path, matched)
        refs = [p for p in path if p.start < length]
        with self._lock:
            nodes = self._index.nodes(refs)
            RadixIndex.pin(nodes)
            held = [p for p in nodes if p.pending and not p.in_ram and not p.on_device and p.key not in found]
            pinned = Pinned(refs, length, tuple(dict.fromkeys(p.pending for p in held)),
                            min((p.start for p in held), default=length))
            self._look(pinned, found)
        return pinned

    def view(self, pinned: Pinned, found: Mapping[bytes, Stored] = {}) -> None:
        """Where ``pinned``'s blocks are now (after waiting for their puts)."""
        with self._lock:
            self._look(pinned, found)

    def _look(self, pinned: Pinned, found: Mapping[bytes, Stored]) -> None:
        items, sizes, on_disk = [], [], {}
        path = self._index.as_found(pinned.path)
        keys = [p.key for p in path]
        for p, dev, ram in zip(path, self.device.get_many(keys) if self._on_device else repeat(None),
                               self._ram.get_many(keys)):
            b = dev or (ram if p.in_ram else None)
            got = b if b is not None else found.get(p.key)
            items.append(b)
            sizes.append(p.nbytes if got is None else got.nbytes)
            if got is None:
                on_disk[p.key] = (p.offset, p.nbytes)
        pinned.items, pinned.sizes, pinned.on_disk = items, sizes, on_disk
        pinned.constrained = any(p.snap is not None or p.gap for p in pinned.path)

    def served(self, pinned: Pinned, used: Sequence[BlockRef], from_disk: Sequence[BlockRef],
               on_device: Sequence, when: float) -> Touched:
        """A fetch served ``used`` at ``when`` (ancestors end up more recent than descendants: eviction takes
        leaves first), made device copies (``DeviceBlock``s, kept as room allows: a block kept there leaves RAM)
        and unpins ``pinned``. Says which used blocks have a disk copy, which of ``from_disk`` to copy into RAM
        (fit its budget) and which device copies it evicted to copy back to RAM (held nowhere else)."""
        with self._lock:
            demote = self.device.keep(on_device, self._pinned, self._leave_ram) if on_device else []
            on_disk = [p for p in self._index.nodes(used) if p.on_disk]
            if on_disk and self._has_disk:
                self.disk.used(on_disk, when)
            disk_keys = [p.key for p in on_disk]
            self._ram.touch([p.key for p in reversed(used)])
            if self._on_device:
                self.device.touch([p.key for p in used])
            promote = [r for r in from_disk if (n := self._index.node(r)) is not None and n.on_disk
                       and not n.on_device and n.nbytes <= self._ram.budget]
            self._release(pinned)
        return Touched(disk_keys, promote, demote)

    def release(self, pinned: Pinned) -> None:
        """Unpin a fetch's blocks (nothing served)."""
        with self._lock:
            self._release(pinned)

    def _release(self, pinned: Pinned) -> None:
        if pinned.done:
            return
        pinned.done = True
        RadixIndex.unpin(self._index.nodes(pinned.path))
        self._make_room(0)  # blocks promoted while pinned may have left RAM over budget

    def _pinned(self, key: bytes) -> bool:
        node = self._index.get(key)
        return node is not None and node.pins > 0

    # ------------------------------------------------------------ results

    def promoted(self, ref: BlockRef, block: Stored) -> None:
        """Keep a block read from disk or the remote in RAM, if it is not there
        yet and fits beside pinned ones."""
        with self._lock:
            node = self._index.node(ref)
            if node is not None and not node.in_ram:
                self._promote(node, block)

    def keep_found(self, parent: BlockRef, found: Sequence[tuple[BlockRecord, Stored]], now: float,
                   pending: Optional[Callable[[list[BlockRef]], int]]) -> list[BlockRef]:
        """Index blocks read from the remote as a chain below ``parent``, into RAM as far as they fit; returns
        the nodes that were new. They wait for the put ``pending(new)`` registers with the writer (their disk
        copy); without one, those held nowhere leave the index (with what is below them)."""
        fresh: list[Node] = []
        pinned: list[Node] = []
        with self._lock:
            parent = self._index.node(parent)
            if parent is None:
                return []  # dropped while we read
            for rec, block in found:
                node = self._index.get(rec.key)
                if node is None:
                    try:
                        node = self._index.add(parent, rec.key, rec.start, rec.length, rec.first, rec.snap,
                                               rec.gap, rec.first_row if rec.gap else None)
                    except (KeyError, ValueError):
                        break
                    node.used = now
                    fresh.append(node)
                elif node.parent is not parent:
                    break
                RadixIndex.pin([node])  # promoting the next one must not evict this one
                pinned.append(node)
                if not node.in_ram:
                    self._promote(node, block)
                parent = node
            RadixIndex.unpin(pinned)
            pid = pending([p.ref() for p in fresh]) if fresh and pending is not None else 0
            for node in fresh:
                if pid:
                    node.pending = pid  # evicted from RAM before its disk write, it stays indexed
                elif not node.in_ram and self._index.get(node.key) is node:
                    self._forget(node)
                    break
        return [p.ref() for p in fresh]

    # ----------------------------------------------------------------- RAM

    def set_ram_budget(self, budget: int) -> None:
        with self._lock:
            self._ram.set_budget(budget)
            self._make_room(0)

    def close(self) -> None:
        """Let go of the RAM tier's blocks now (a store closing), not in a
        garbage collection during some later request (``buffers.reserve``)."""
        with self._lock:
            self._make_room(self._ram.budget)
            self._ram.set_budget(0)

    def trim_ram(self, keep_bytes: int) -> None:
        with self._lock:
            if keep_bytes < self._ram.nbytes:
                self._make_room(self._ram.budget - keep_bytes)

    def bad(self, ref: BlockRef) -> list[bytes]:
        """Drop the block and its subtree if still indexed; returns the keys of
        those with a disk copy (for the caller to delete, unlocked)."""
        with self._lock:
            node = self._index.node(ref)
            return self._forget(node, "corrupt") if node is not None else []

    def clear(self) -> None:
        with self._lock:
            for r in self._index.roots():
                for child in list((r.children or {}).values()):
                    self._forget(child)

    # ------------------------------------------------------ lock held below

    def _admit(self, node: Node, block: Stored) -> bool:
        if block.nbytes > self._ram.budget:
            return False
        ancestors = node.path()[:-1]
        RadixIndex.pin(ancestors)
        try:
            self._make_room(block.nbytes)
        finally:
            RadixIndex.unpin(ancestors)
        if self._index.get(node.key) is not node or self._ram.over(block.nbytes) > 0:
            return False  # dropped meanwhile, or its prefix and pinned blocks fill RAM
        self._ram.add(node.key, block)
        node.in_ram = True
        self._ram.touch([p.key for p in reversed(ancestors) if p.in_ram])  # leaves stay the oldest
        return True

    def _promote(self, node: Node, block: Stored) -> None:
        if block.nbytes > self._ram.budget or self._index.get(node.key) is not node:
            return
        self._make_room(block.nbytes)
        if self._ram.over(block.nbytes) <= 0:
            self._ram.add(node.key, block)
            node.in_ram = True

    def _make_room(self, extra: int) -> None:
        """Evict least recently used blocks until ``extra`` more bytes fit."""
        need = self._ram.over(extra)
        if need <= 0:
            return
        victims: list[tuple[bytes, Optional[Node]]] = []
        freed = 0
        for key, block in self._ram.oldest():
            node = self._index.get(key)
            if node is not None and node.pins:
                continue
            victims.append((key, node))
            freed += block.nbytes
            if freed >= need:
                break
        for key, node in victims:
            if self._ram.over(extra) <= 0:
                return
            if node is None:
                self._ram.pop(key)
            elif node.in_ram:  # not dropped with an evicted ancestor's subtree meanwhile
                self._evict(node)

    def _leave_ram(self, node: Node) -> None:
        if node.in_ram:
            self._ram.pop(node.key)
            node.in_ram = False

    def _evict(self, node: Node) -> None:
        self._counters.count("evictions_ram")
        unwritten = node.pending and not node.on_disk and self._has_disk and self._writable
        if node.on_disk or unwritten or node.on_device:
            if unwritten:
                self._counters.count("evicted_unwritten")
            self._ram.pop(node.key)
            node.in_ram = False
        else:
            if self.admissions.on:
                self._counters.count("evicted_unadmitted")
            self._forget(node)

    def _forget(self, node: Node, why: str = "evicted") -> list[bytes]:
        dropped = self._index.remove(node)
        self._gone.add((d.key for d in dropped), why)
        for d in dropped:
            self._ram.pop(d.key)
            self.device.dropped(d.key)
            d.in_ram = d.on_device = False
        self.disk.dropped(dropped)
        return [d.key for d in dropped if d.on_disk]
