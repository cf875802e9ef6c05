"""What the table hands out besides single ``BlockRef``s: a fetch's plan
(``BlockTable.plan_fetch``, handed back to ``release``) and what the cost
plan needs of a path."""

from __future__ import annotations

from dataclasses import dataclass

from .index import BlockRef


@dataclass(frozen=True)
class FetchPlan:
    """A fetch's blocks, pinned until ``BlockTable.release``: the path up to
    the servable ``length`` (each block as its ref says where it was) and the
    jobs still storing blocks of it that are in no tier yet (the fetch waits
    for them, or takes their rows: ``queued``)."""

    path: list[BlockRef]
    length: int
    jobs: list


@dataclass
class PlanView:
    """What the cost plan needs of a path, read under the lock at once."""

    sizes: list[int]
    in_ram: list[bool]
    constrained: bool  # a snapshot or a window limits which lengths are servable
    on_disk: dict[bytes, tuple[int, int]]  # key -> (offset, bytes) of blocks to read from disk
