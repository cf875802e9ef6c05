"""SSD admission on reuse (``ssd_admit="reuse"``): the table's side.

A new block is kept in RAM with its record (``Node.record``) and goes to
disk only once it is asked for again: a later put shares it, or a fetch
serves it from RAM or the device. Then its whole chain from the root is
admitted, parents first, so no block reaches disk without its parent (an
orphan). A block dropped from RAM before that is gone (``evicted_unadmitted``).

``Admissions`` owns whether this is on and the queue of chains asked for
again; the table makes it with the index, its one lock and a read of the RAM
tier's bytes (``held``: admissions never change RAM).
"""

from __future__ import annotations

from typing import Callable, Optional

from .index import BlockRef, Node, RadixIndex
from ..blocks.record import Entry
from ..blocks.wire import Stored


class Admissions:
    def __init__(self, index: RadixIndex, lock, held: Callable[[bytes], Optional[Stored]], on: bool):
        self._index = index
        self._lock = lock  # the table's
        self._held = held
        self.on = on  # ``ssd_admit="reuse"`` on a writable store with a disk
        self._queue: list[Node] = []  # chains asked for again, to admit to disk (``take``)

    def reused(self, ref: BlockRef) -> None:
        """The block (and so its prefix) was asked for again; its chain's blocks
        without a disk copy are queued for admission (``take``)."""
        with self._lock:
            node = self._index.node(ref)
            if node is not None:
                self._reused(node)

    def _reused(self, node: Node) -> None:
        if not self.on or node.is_root:
            return
        path = node.path()
        for p in path:
            p.reused = True
        if not all(p.on_disk for p in path):
            self._queue.append(node)

    def shared(self, new: list[Node], walked: Callable[[], Node], block_size: int) -> None:
        """Under the lock: a put indexed ``new``. Where it leaves the blocks it
        shares, another prompt went on with a whole block of its own, then
        those blocks were asked for again. A put that only extends a stored
        sequence (the same request's prompt, then prompt and answer; a partial
        last block grown) asks for nothing again: a later turn's fetch does."""
        top = new[0].parent if new else walked()
        if any(c.length == block_size and (not new or c is not new[0]) for c in (top.children or {}).values()):
            self._reused(top)

    def take(self) -> list[BlockRef]:
        """Chains to admit, queued since the last call (for the writer's ``claim``)."""
        with self._lock:
            out, self._queue = self._queue, []
            return [n.ref() for n in out]

    def to_disk(self, node: Node, pending: int) -> bool:
        """Under the lock, while the put ``pending`` admits ``node`` to RAM:
        whether it goes to disk now (reused, and its parent on disk or written
        before it by that put); else it waits in RAM for ``claim``."""
        if not self.on:
            return True
        parent = node.parent
        return node.reused and (parent.is_root or parent.on_disk or parent.pending == pending)

    def claim(self, leaves: list[BlockRef], pending: Callable[[list[BlockRef], dict[bytes, Entry]], int]) -> int:
        """The writer's put of the chains of ``leaves``' blocks held in RAM
        only, parents first (``pending(blocks, entries)`` registers it and
        gives its id); 0 when none is left.
        A chain stops at a block another job still holds: its children wait."""
        with self._lock:
            nodes: list[Node] = []
            entries: dict[bytes, Entry] = {}
            for leaf in self._index.nodes(leaves):
                for p in leaf.path():
                    if p.on_disk or p.key in entries:
                        continue
                    block = self._held(p.key)
                    if p.pending or block is None or p.record is None:
                        break
                    nodes.append(p)
                    entries[p.key] = Entry(p.record, block.buf)
            if not nodes:
                return 0
            pid = pending([p.ref() for p in nodes], entries)
            for p in nodes:
                p.pending = pid
            return pid
