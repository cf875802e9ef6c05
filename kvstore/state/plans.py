"""What crosses the table's boundary besides single ``BlockRef``s: a fetch's
lookup and its pinned blocks (``BlockTable.lookup``, ``pin``, handed back to
``served`` or ``release``), and where the writer's encoded block went
(``BlockTable.encoded``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from .index import BlockRef


class Candidate(NamedTuple):
    """A stored block the prompt may end or diverge inside of: its ref, its tokens where the table holds them
    (RAM), else the writer's id of the put still storing it (``Writer.tokens``), or 0 (read them from disk)."""

    ref: BlockRef
    tokens: Optional[np.ndarray]
    pending: int


@dataclass(frozen=True)
class Lookup:
    """``BlockTable.lookup``: the whole blocks of a prompt found by key (``path``, ending at ``stop``, the root's
    ref when none) and the blocks below ``stop`` it may end or diverge inside of."""

    stop: BlockRef
    path: list[BlockRef]
    candidates: list[Candidate]

    @property
    def length(self) -> int:
        return self.path[-1].end if self.path else 0


@dataclass
class Pinned:
    """A fetch's blocks, pinned until ``BlockTable.served`` or ``release``: the path up to the servable
    ``length`` and, as of the last look (``pin``, ``view``), where each block is. ``pending``: the puts still
    storing blocks of it that are in no tier yet (the fetch waits for them, or takes their rows from
    ``queued_from`` on); ``items``: per block, its device copy or RAM bytes (or the remote's, just read), else
    ``None``; ``on_disk``: key -> (offset, bytes) of the blocks to read from disk."""

    path: list[BlockRef]
    length: int
    pending: tuple[int, ...] = ()
    queued_from: int = 0
    items: list = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    constrained: bool = False  # a snapshot or a window limits which lengths are servable
    on_disk: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    done: bool = False  # unpinned (``served`` or ``release``): once only


class Touched(NamedTuple):
    """``BlockTable.served``: the keys of the used blocks with a disk copy, the blocks to promote to RAM, and
    the device copies evicted to copy back to RAM (``DeviceSide.copy_back``)."""

    disk_keys: list[bytes]
    promote: list[BlockRef]
    demote: list = []


class Placed(enum.Enum):
    """Where ``BlockTable.encoded`` put a freshly encoded block."""

    TO_DISK = "to disk"  # in RAM as far as it fits, and to be written
    RAM_ONLY = "in RAM until asked for again"  # (ssd_admit="reuse")
    NOT_KEPT = "not this put's to store"  # dropped meanwhile, or re-encoded by a later put; or RAM-only and no room
