"""The disk side of ``BlockTable``: what the LMDB tier holds, as the table
records it (written, evicted, found by this or another process).

``DiskSide`` owns that record, the disk LRU (``DiskOrder``, with the count of
blocks on disk) and adoption; the table makes it with the index, its one lock
and its ``forget`` (a block dropping out of the index leaves every tier, not
only this one), and hands it the results that are its own (``handlers``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from .disk_order import DiskOrder
from .index import BlockRef, Node, RadixIndex
from ..blocks.record import BlockRecord


class DiskSide:
    def __init__(self, index: RadixIndex, lock, forget: Callable[[Node], list[bytes]]):
        self._index = index
        self._lock = lock  # the table's
        self._forget = forget
        self._order = DiskOrder(index)

    # ------------------------------------------------ the table's own steps, under its lock

    def used(self, nodes: list[Node], when: float) -> None:
        """Blocks on disk were served at ``when``: their places in the disk LRU."""
        for node in nodes:
            node.used = when
        self._order.push_all(nodes)

    def dropped(self, nodes: list[Node]) -> None:
        """The table dropped ``nodes`` (a block and its subtree) from the index."""
        self._order.dropped(nodes)

    # ------------------------------------------------------------------ what the disk path tells and asks

    def written(self, pairs: Iterable[tuple[BlockRef, BlockRecord]]) -> None:
        """These blocks' records and bytes are on disk now."""
        with self._lock:
            for ref, rec in pairs:
                node = self._index.node(ref)
                if node is None:
                    continue  # dropped meanwhile
                node.nbytes, node.used, node.offset = rec.nbytes, rec.used, rec.offset
                node.record = None  # (held for admission on reuse until now)
                self._order.mark(node, True)

    @property
    def blocks(self) -> int:
        """Indexed blocks with a disk copy."""
        return self._order.blocks

    def victims(self, nbytes: int) -> list[BlockRef]:
        """Least recently used disk leaves, unpinned, about ``nbytes`` of them
        (hand them back to ``left``)."""
        with self._lock:
            return [v.ref() for v in self._order.victims(nbytes)]

    def left(self, victims: Sequence[BlockRef], deleted: set[bytes]) -> None:
        """``deleted`` of ``victims`` (``victims``) left the disk; a block then
        in no tier leaves the index."""
        with self._lock:
            for v in self._index.nodes(victims):
                if v.key not in deleted and v.on_disk:
                    self._order.push(v)  # another process removed it first, or it survived: keep it known
                    continue
                self._order.mark(v, False)
                if not v.in_ram and not v.on_device and not v.pending:
                    self._forget(v)

    def adopted(self, parent: BlockRef, records: Sequence[BlockRecord]) -> int:
        """Index blocks found on disk below ``parent`` (by this or another
        process); returns how many were indexed."""
        with self._lock:
            node = self._index.node(parent)
            if node is None:
                return 0
            return sum(self._adopt(node, rec) is not None for rec in records)

    def adopt_all(self, by_parent: dict[bytes, list[BlockRecord]], roots: Iterable[bytes]) -> None:
        """Rebuild from disk: every block whose parent chain is whole (what is
        left in ``by_parent`` has none)."""
        with self._lock:
            for r in roots:
                stack = [self._index.root(r)]
                while stack:
                    node = stack.pop()
                    for rec in by_parent.pop(node.key, []):
                        child = self._adopt(node, rec)
                        if child is not None:
                            stack.append(child)

    def _adopt(self, parent: Node, rec: BlockRecord) -> Optional[Node]:
        if rec.parent != parent.key:
            return None
        try:
            node = self._index.add(parent, rec.key, rec.start, rec.length, rec.first, rec.snap, rec.gap,
                                   rec.first_row if rec.gap else None)
        except (KeyError, ValueError):
            return None
        node.nbytes, node.used, node.offset = rec.nbytes, max(node.used, rec.used), rec.offset
        self._order.mark(node, True)
        return node

    def keys(self) -> list[bytes]:
        """Keys of the indexed blocks with a disk copy."""
        with self._lock:
            return [n.key for n in self._index if n.on_disk]

    def removed(self, keys: set[bytes]) -> int:
        """Blocks removed from disk by another process (a clear) leave the
        index with the blocks under them, in RAM or not (a RAM copy of a block
        whose disk copy is gone would never be written again: the next put
        stores it anew). Returns how many blocks with a disk copy left."""
        with self._lock:
            n = 0
            for key in keys:
                node = self._index.get(key)
                if node is not None and node.on_disk:
                    n += len(self._forget(node))
            return n

    def gone(self, ref: BlockRef) -> None:
        """A block the index has on disk is no longer there (another process
        removed it): it leaves the index with the blocks under it."""
        with self._lock:
            node = self._index.node(ref)
            if node is not None and not node.in_ram and not node.on_device and not node.pending:
                self._forget(node)

    def offset_found(self, ref: BlockRef, offset: int) -> None:
        """Where a block written before offsets were recorded sits (for residency checks)."""
        with self._lock:
            node = self._index.node(ref)
            if node is not None:
                node.offset = offset
