"""What crosses the table's boundary besides single ``BlockRef``s: a fetch's
lookup and its pinned blocks (``BlockTable.lookup``, ``pin``, handed back to
``served`` or ``release``), and the results the other paths hand back to
``BlockTable.apply``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Sequence

import numpy as np

from ..blocks.record import BlockRecord
from ..blocks.wire import Stored
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

    @property
    def in_ram(self) -> list[bool]:
        return [b is not None for b in self.items]


class Touched(NamedTuple):
    """``BlockTable.served``: the keys of the used blocks with a disk copy, and the blocks to promote to RAM."""

    disk_keys: list[bytes]
    promote: list[BlockRef]


# ------------------------------------------------- results, handed back to ``BlockTable.apply``
# What the paths did with the blocks of a plan. Each names its blocks by ref; the table ignores refs to blocks
# dropped meanwhile.

class Placed(enum.Enum):
    """Where ``BlockTable.apply(Encoded(...))`` put a freshly encoded block."""

    TO_DISK = "to disk"  # in RAM as far as it fits, and to be written
    RAM_ONLY = "in RAM until asked for again"  # (ssd_admit="reuse")
    NOT_KEPT = "not this put's to store"  # dropped meanwhile, or re-encoded by a later put; or RAM-only and no room


@dataclass(frozen=True)
class Encoded:
    """The writer encoded a block of its put ``pending``: ``apply`` admits it to RAM and says where it goes
    (``Placed``)."""

    ref: BlockRef
    pending: int
    block: Stored
    ram_only: bool
    record: Optional[BlockRecord] = None


@dataclass(frozen=True)
class JobDone:
    """The put ``pending`` is finished with these blocks (written, or, ``dropped``, failed): one in no tier
    leaves the index."""

    pending: int
    refs: Sequence[BlockRef]
    dropped: bool = False


@dataclass(frozen=True)
class JobReleased:
    """The put ``pending`` no longer holds these blocks (a fetch need not wait for it)."""

    pending: int
    refs: Sequence[BlockRef]


@dataclass(frozen=True)
class Written:
    """These blocks' records and bytes are on disk now."""

    pairs: Iterable[tuple[BlockRef, BlockRecord]]


@dataclass(frozen=True)
class LeftDisk:
    """``deleted`` of ``victims`` (``DiskSide.victims``) left the disk."""

    victims: Sequence[BlockRef]
    deleted: set


@dataclass(frozen=True)
class Adopted:
    """Blocks found on disk below ``parent`` (written by this or another process): ``apply`` returns how many
    were indexed."""

    parent: BlockRef
    records: Sequence[BlockRecord]


@dataclass(frozen=True)
class _OneBlock:
    ref: BlockRef


@dataclass(frozen=True)
class OffsetFound:
    """Where a block written before offsets were recorded sits in the file."""

    ref: BlockRef
    offset: int


class GoneFromDisk(_OneBlock):
    """A block the index has on disk is no longer there (another process removed it)."""


class Bad(_OneBlock):
    """A block failed its check: it leaves the index with its subtree; ``apply`` returns the keys with a disk
    copy (for the caller to delete, unlocked)."""


@dataclass(frozen=True)
class Promoted:
    """A block read from disk or the remote, to keep in RAM if it is not there and fits."""

    ref: BlockRef
    block: Stored


class Reused(_OneBlock):
    """A block (so its prefix) was asked for again (``ssd_admit="reuse"``)."""
