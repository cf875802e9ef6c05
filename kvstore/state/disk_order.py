"""The disk tier's eviction order: blocks on disk with no child on disk (the
only ones that may leave it), least recently used first.

A heap kept lazily: every use pushes an entry, stale ones are skipped as
they surface and dropped when they outnumber the live ones, so evicting one
block costs O(log n) however many blocks the store holds. It also keeps
what the heap reads (``Node.on_disk``, each parent's ``disk_kids``) and the
count of blocks on disk, so they change only together (``mark``,
``dropped``). Owned by the table's ``DiskSide`` and used under the table's
lock.
"""

from __future__ import annotations

import heapq
import itertools

from .index import Node, RadixIndex


class DiskOrder:
    def __init__(self, index: RadixIndex):
        self._index = index
        self._heap: list[tuple[float, int, Node]] = []  # (last use, tie-break, node)
        self._seq = itertools.count()
        self.blocks = 0  # indexed blocks with a disk copy

    def mark(self, node: Node, on_disk: bool) -> None:
        """Set ``node.on_disk``, keeping the count, its parent's ``disk_kids`` and the heap."""
        if node.on_disk == on_disk:
            return
        node.on_disk = on_disk
        parent = node.parent
        if on_disk:
            self.blocks += 1
            if parent is not None and not parent.is_root:
                parent.disk_kids += 1
            self.push(node)
        else:
            self.blocks -= 1
            if parent is not None and not parent.is_root:
                parent.disk_kids -= 1
                self.push(parent)

    def dropped(self, nodes: list[Node]) -> None:
        """``nodes`` (a block, then its subtree: ``RadixIndex.remove``) left the
        index: those on disk leave the count, and the block its parent's
        ``disk_kids`` (a parent left with none on disk may leave the disk next)."""
        self.blocks -= sum(d.on_disk for d in nodes)
        top = nodes[0] if nodes else None
        if top is not None and top.on_disk and top.parent is not None and not top.parent.is_root:
            top.parent.disk_kids -= 1
            self.push(top.parent)

    def push(self, node: Node) -> None:
        """``node``'s last use or its children changed: a leaf on disk is (re)entered."""
        if node.on_disk and node.disk_kids == 0:
            heapq.heappush(self._heap, (node.used, next(self._seq), node))
            if len(self._heap) > 2 * self.blocks + 1024:
                self._compact()

    def push_all(self, nodes: list[Node]) -> None:
        """``push`` of each (a hit's blocks at once)."""
        for node in nodes:
            self.push(node)

    def victims(self, nbytes: int) -> list[Node]:
        """Least recently used disk leaves, unpinned, about ``nbytes`` of them
        (taken out of the order; the caller pushes back what stays)."""
        out, held, freed, seen = [], [], 0, set()
        while self._heap and freed < nbytes:
            used, _, node = heapq.heappop(self._heap)
            if not self._live(used, node) or id(node) in seen:
                continue  # stale entry
            seen.add(id(node))
            if node.pins:
                held.append(node)
                continue
            out.append(node)
            freed += max(node.nbytes, 1)
        for node in held:
            self.push(node)
        return out

    def _live(self, used: float, node: Node) -> bool:
        return used == node.used and node.on_disk and not node.disk_kids and self._index.get(node.key) is node

    def _compact(self) -> None:
        """Drop stale entries (every use pushes one): amortized O(1) per push."""
        live = {id(node): (used, seq, node) for used, seq, node in self._heap if self._live(used, node)}
        self._heap = list(live.values())
        heapq.heapify(self._heap)
