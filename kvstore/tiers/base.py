"""The protocol every tier keeps (RAM, LMDB, and any remote one).

One meaning per verb, whatever the medium:

- ``load(wanted)``: the blocks asked for, decoded and checked (a block bound
  to another key, torn or corrupt is reported in ``bad``, never returned).
- ``store(entries)``: keep these blocks (a persistent tier writes each
  payload and its record together: a reader sees both or neither).
- ``remove(keys)``: forget these blocks; returns the keys that were there.
- ``touch(uses)``: these blocks were served (when, how many times): order
  for LRU, last-use times and hit counts for people.
- ``usage()``: bytes held, as the tier's own budget counts them.
- ``close()``: release what the tier holds open.

Which block goes where, and when, is the store's decision (``placement``,
``persist``); a tier only keeps, finds and counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional, Protocol, Sequence

from ..codec import Block
from ..wire import deserialize, serialize
from ..errors import BlockDecodeError
from ..record import BlockRecord


@dataclass(frozen=True)
class Use:
    """Blocks served: the last time, and how many times since the last save."""

    when: float
    hits: int = 1


@dataclass
class Entry:
    """A block to keep, with its index record. The payload (the block's bytes
    as every tier stores them) is made once, on first use, unless the maker
    set it (the writer serializes each block once; a remote read brings it)."""

    record: BlockRecord
    block: Optional[Block]

    @property
    def key(self) -> bytes:
        return self.record.key

    @cached_property
    def payload(self) -> memoryview:
        return serialize(self.block, self.record.key)


@dataclass
class Loaded:
    """What ``load`` found: decoded blocks by key, and why others were refused."""

    blocks: dict[bytes, Block] = field(default_factory=dict)
    bad: dict[bytes, str] = field(default_factory=dict)


def decode_into(out: Loaded, key: bytes, start: int, buf) -> bool:
    """Decode one stored value into ``out`` (checked, bound to ``key``); False,
    with the reason in ``out.bad``, when it is not a good block."""
    try:
        out.blocks[key] = deserialize(buf, start, key=key)
        return True
    except BlockDecodeError as e:
        out.bad[key] = str(e)
        return False


class Tier(Protocol):
    name: str
    budget: int

    def load(self, wanted: Sequence[tuple[bytes, int]]) -> Loaded:
        """Blocks by ``(key, first token position)``; stops at the first one
        missing or bad, since a prefix cannot skip a block."""

    def store(self, entries: Sequence[Entry]) -> None: ...

    def remove(self, keys: Sequence[bytes]) -> list[bytes]: ...

    def touch(self, uses: Mapping[bytes, Use]) -> None: ...

    def usage(self) -> int: ...

    def close(self) -> None: ...
