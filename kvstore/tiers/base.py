"""``Tier``: the protocol every place a block can live keeps -- device
(GPU memory), RAM, disk (LMDB) and remote (Redis / Valkey).

A tier keeps blocks by key as their serialized bytes (``wire``): what one
tier hands out another takes, so a block moves between tiers without being
decoded. The verbs are per block key; each tier adds its own fast paths
beside them (the RAM tier's LRU order, the disk tier's zero-copy reads inside
a transaction, the remote's pipelined, streamed reads), and the
``BlockTable`` alone decides which blocks a tier keeps.

>>> from kvstore.tiers.ram import RamTier
>>> isinstance(RamTier(1 << 20), Tier)
True
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

from ..blocks.record import Entry
from ..blocks.wire import Stored


@runtime_checkable
class Tier(Protocol):
    name: str  # "device", "ram", "disk" or "remote": what ``stats()`` and the cost model call it

    def get(self, key: bytes) -> Optional[Stored]:
        """The block's bytes held here (header checked, bound to ``key``), else ``None``."""

    def put(self, entries: Sequence[Entry]) -> int:
        """Keep these blocks (a tier may keep fewer: over its budget); returns how many it kept."""

    def contains(self, key: bytes) -> bool:
        """Whether the block is here, reading none of its bytes."""

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Let these blocks go; returns the keys that were here."""
