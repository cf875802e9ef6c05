"""What crosses the table's boundary besides single ``BlockRef``s: a fetch's
plan (``BlockTable.plan_fetch``, handed back to ``release``), what the cost
plan needs of a path, and the results the paths hand back to
``BlockTable.apply``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..blocks.record import BlockRecord
from ..blocks.wire import Stored
from .index import BlockRef


@dataclass(frozen=True)
class FetchPlan:
    """A fetch's blocks, pinned until ``BlockTable.release``: the path up to
    the servable ``length`` (each block as its ref says where it was) and the
    jobs still storing blocks of it that are in no tier yet (the fetch waits
    for them, or takes their rows from ``queued_from`` on: ``queued``)."""

    path: list[BlockRef]
    length: int
    jobs: list
    queued_from: int = 0  # where the first block a job still holds (in no tier yet) starts; ``length`` if none


@dataclass
class PlanView:
    """What the cost plan needs of a path, read under the lock at once."""

    sizes: list[int]
    in_ram: list[bool]
    constrained: bool  # a snapshot or a window limits which lengths are servable
    on_disk: dict[bytes, tuple[int, int]]  # key -> (offset, bytes) of blocks to read from disk


# ------------------------------------------------- results, handed back to ``BlockTable.apply``
# What the paths did with the blocks of a plan. Each names its blocks by ref; the table ignores refs to blocks
# dropped meanwhile.

@dataclass(frozen=True)
class Encoded:
    """The writer encoded a block of ``job``: ``apply`` admits it to RAM and says where it goes (True: to disk;
    None: kept in RAM only until asked for again; False: no longer this job's to store)."""

    ref: BlockRef
    job: object
    block: Stored
    ram_only: bool
    record: Optional[BlockRecord] = None


@dataclass(frozen=True)
class JobDone:
    """``job`` is finished with these blocks (written, or, ``dropped``, failed): one in no tier leaves the index."""

    job: object
    refs: Sequence[BlockRef]
    dropped: bool = False


@dataclass(frozen=True)
class JobReleased:
    """``job`` no longer holds these blocks (a fetch need not wait for it)."""

    job: object
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
class Used:
    """A hit served ``path`` at ``when``; ``apply`` returns the keys of those with a disk copy."""

    path: Sequence[BlockRef]
    when: float


@dataclass(frozen=True)
class OnDevice:
    """Device copies a hit made (``DeviceBlock``s), to keep in the device tier."""

    blocks: Sequence


@dataclass(frozen=True)
class Promoted:
    """A block read from disk or the remote, to keep in RAM if it is not there and fits."""

    ref: BlockRef
    block: Stored


class Reused(_OneBlock):
    """A block (so its prefix) was asked for again (``ssd_admit="reuse"``)."""
