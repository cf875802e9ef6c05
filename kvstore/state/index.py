"""Radix index over block keys.

Block keys are chained (each hashes its parent's key), so a key names a whole
prefix: the tree needs no token labels on its edges, and a flat ``dict`` from
key to node gives O(1) descent per block. Nodes keep their parent and children
for leaf-first eviction and subtree removal, and a pin count so a reader in
flight never loses a block under it.

The index holds no payloads and no token ids; stored tokens live with each
block's payload and are compared on every hit, so a hash collision is a miss.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

# `gap` values: which layers a block lacks rows for.
NO_GAP = 0  # every KV layer has its rows
FULL_GAP = -1  # a full-attention layer lacks rows: no prefix through here is servable

_IDENT = itertools.count(1)
_new_ref = tuple.__new__  # (next() is atomic under the GIL: nodes are made under the table's lock anyway)


class BlockRef(NamedTuple):
    """A block as the table hands it out (``Node`` never leaves ``state``):
    where it sits in its prompt, what its rows are, and, as of when the table
    made the ref, where it was. ``ident`` names the indexed block: one dropped
    and stored again under the same key is another, and the table ignores a
    ref to the old one. Immutable; hand it back to the table to act on the block."""

    key: bytes
    parent: Optional[bytes]  # its parent's key (the root key for a first block); None for a root
    start: int
    length: int
    first: int
    snap: Optional[bool]
    gap: int
    rows_from: int
    ident: int
    in_ram: bool = False
    on_disk: bool = False
    nbytes: int = 0  # payload bytes on disk
    offset: int = -1  # where its bytes sit in the LMDB file (-1: unknown)
    end: int = 0  # start + length (a field, not a property: the fetch path reads it for every block, often)

    @property
    def is_root(self) -> bool:
        return self.parent is None


class Node:
    """One block: ``length`` tokens starting at token ``start`` of its prompt.

    ``snap`` is ``None`` when the model has no recurrent-state layers, else
    whether this block carries the state snapshot taken at its end. ``gap`` is
    ``NO_GAP``, ``FULL_GAP``, or the largest sliding window of a layer whose
    rows this block lacks in part: those layers hold rows only from token
    ``rows_from`` on, which serves every length whose window starts there or
    later.
    """

    __slots__ = ("key", "parent", "children", "start", "length", "first", "snap", "gap", "rows_from",
                 "end", "in_ram", "on_disk", "on_device", "pins", "pending", "nbytes", "used", "disk_kids", "offset", "reused", "record", "ident")

    def __init__(self, key: bytes, parent: Optional["Node"], start: int, length: int,
                 first: int = -1, snap: Optional[bool] = None, gap: int = NO_GAP,
                 rows_from: Optional[int] = None):
        self.key = key
        self.parent = parent
        self.children: Optional[dict[bytes, Node]] = None
        self.start = start
        self.length = length
        self.end = start + length
        self.first = first
        self.snap = snap
        self.gap = gap
        self.rows_from = start if rows_from is None else rows_from
        self.in_ram = False
        self.on_disk = False
        self.on_device = False  # a device copy (CUDA), the table's own (RAM holds what the device does not)
        self.pins = 0
        self.pending = 0  # the writer's id of the put that has not yet made this block durable (0: none)
        self.nbytes = 0  # payload bytes on disk (disk eviction frees about this much)
        self.used = 0.0  # last use, for disk LRU order
        self.disk_kids = 0  # children on disk: only a block with none may leave the disk
        self.offset = -1  # where its bytes sit in the LMDB file (-1: unknown), for residency checks
        self.reused = False  # asked for again (``ssd_admit="reuse"``: it may go to disk)
        self.record = None  # its BlockRecord while it waits in RAM for admission to disk (``table_admit``)
        self.ident = next(_IDENT)

    def ref(self) -> BlockRef:
        """This block as handed out of the table (``tuple.__new__``: half the cost of ``BlockRef(...)``, paid per
        new block on the engine's thread by every put)."""
        return _new_ref(BlockRef, (self.key, None if self.parent is None else self.parent.key, self.start,
                                   self.length, self.first, self.snap, self.gap, self.rows_from, self.ident,
                                   self.in_ram, self.on_disk, self.nbytes, self.offset, self.end))

    is_root = BlockRef.is_root  # (the same property: a ref and its node answer alike)

    @property
    def held(self) -> bool:
        """In a tier: RAM, disk or the device (a block in none leaves the index)."""
        return self.in_ram or self.on_disk or self.on_device

    def path(self) -> list["Node"]:
        """Blocks from the first to this one (the root sentinel excluded)."""
        out = []
        n = self
        while n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return f"Node({self.key.hex()[:8]}, {self.start}+{self.length}, ram={self.in_ram}, disk={self.on_disk})"


@dataclass
class Walk:
    """Longest run of whole blocks of a prompt found in the index."""

    root: Node
    nodes: list[Node] = field(default_factory=list)

    @property
    def last(self) -> Node:
        return self.nodes[-1] if self.nodes else self.root

    @property
    def length(self) -> int:
        return self.last.end if self.nodes else 0


class RadixIndex:
    def __init__(self):
        self._nodes: dict[bytes, Node] = {}
        self._roots: dict[bytes, Node] = {}
        self.leaves = 0  # blocks with no children: the stored sequences no other one extends

    def __len__(self) -> int:
        """Number of blocks (root sentinels excluded)."""
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self._nodes.values()))

    def __contains__(self, key: bytes) -> bool:
        return key in self._nodes

    def get(self, key: bytes) -> Optional[Node]:
        return self._nodes.get(key)

    def node(self, ref: BlockRef) -> Optional[Node]:
        """The indexed block ``ref`` names (a root's sentinel for a root's ref), ``None`` once it was dropped."""
        if ref.parent is None:
            return self.root(ref.key)
        node = self._nodes.get(ref.key)
        return node if node is not None and node.ident == ref.ident else None

    @staticmethod
    def refs(nodes: Iterable["Node"]) -> list[BlockRef]:
        """``ref()`` of each node (a walk's at once)."""
        return [n.ref() for n in nodes]

    def as_found(self, refs: Sequence[BlockRef]) -> list:
        """Per ref, its indexed block, or the ref itself where that block was dropped (it stays as it was)."""
        return [self.node(r) or r for r in refs]

    def nodes(self, refs: Iterable[BlockRef]) -> list[Node]:
        """``node`` of each ref, those dropped left out."""
        return [n for r in refs if (n := self.node(r)) is not None]

    def root(self, key: bytes) -> Node:
        """The sentinel every chain of one model and namespace hangs from."""
        node = self._roots.get(key)
        if node is None:
            node = self._roots[key] = Node(key, None, 0, 0)
        return node

    def roots(self) -> list[Node]:
        return list(self._roots.values())

    def add(self, parent: Node, key: bytes, start: int, length: int, first: int = -1,
            snap: Optional[bool] = None, gap: int = NO_GAP, rows_from: Optional[int] = None) -> Node:
        """Insert a block under ``parent`` (which must be indexed), or return the
        block already there."""
        node = self._nodes.get(key)
        if node is not None:
            return node
        self._check_parent(parent, start)
        return self._attach(parent, Node(key, parent, start, length, first, snap, gap, rows_from))

    def add_run(self, parent: Node, keys: Sequence[bytes], start: int, length: int,
                firsts: Sequence[int]) -> list[Node]:
        """``add`` of blocks of ``length`` tokens from ``start`` on, each under
        the one before (a put's new blocks: one pass, the parent checked once)."""
        self._check_parent(parent, start)
        nodes, out = self._nodes, []
        for key, first in zip(keys, firsts):
            node = nodes.get(key)
            if node is None:
                node = Node(key, parent, start, length, first)
                if parent.children is None and parent.parent is not None:
                    parent.children = {key: node}  # a leaf's first child: the count of leaves stays
                    nodes[key] = node
                else:
                    self._attach(parent, node)
            out.append(node)
            parent = node
            start += length
        return out

    def _check_parent(self, parent: Node, start: int) -> None:
        if parent.parent is not None and parent.key not in self._nodes:
            raise KeyError("parent block is not indexed")
        if start != parent.start + parent.length:
            raise ValueError(f"block starts at {start} but its parent ends at {parent.end}")

    def _attach(self, parent: Node, node: Node) -> Node:
        kids = parent.children
        if not kids and parent.parent is not None:
            self.leaves -= 1  # the parent was a leaf
        if kids is None:
            kids = parent.children = {}
        self.leaves += 1
        kids[node.key] = node
        self._nodes[node.key] = node
        return node

    def match(self, root: Node, keys) -> Walk:
        """Walk ``keys`` (an iterable of block keys, in order) from ``root``."""
        result = Walk(root)
        node = root
        for key in keys:
            child = node.children.get(key) if node.children else None
            if child is None:
                break
            result.nodes.append(child)
            node = child
        return result

    def remove(self, node: Node) -> list[Node]:
        """Drop ``node`` and everything below it; returns what was dropped."""
        dropped = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            if self._nodes.pop(n.key, None) is not None and not n.children:
                self.leaves -= 1
            dropped.append(n)
        parent = node.parent
        if parent is not None and parent.children and parent.children.pop(node.key, None) is not None:
            if not parent.children and not parent.is_root:
                self.leaves += 1  # the parent is a leaf again
        return dropped

    @staticmethod
    def pin(nodes) -> None:
        for n in nodes:
            n.pins += 1

    @staticmethod
    def unpin(nodes) -> None:
        for n in nodes:
            n.pins -= 1
