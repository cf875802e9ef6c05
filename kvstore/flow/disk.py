"""The store's side of its LMDB tier: writing batches, staying under the
disk budget, a full device, finding what other processes wrote, the index
rebuilt at open.

Disk I/O runs here, outside the table's lock; what it learns goes to the
``BlockTable`` (which takes its lock only for in-memory steps). Blocks other
processes wrote are known once this process has seen them (at open, or found
by a lookup); each process evicts what it knows.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..config import DEFAULT_BLOCK, StoreConfig
from ..counters import Counters
from ..errors import StoreOpenError
from ..state.index import BlockRef
from ..blocks.record import BlockRecord, Entry
from ..blocks.wire import Stored
from ..state.table import BlockTable
from ..tiers.disk.lmdb import LmdbTier

log = logging.getLogger("kvstore")


class DiskRead:
    """One read transaction on the disk tier (``Disk.reading``): the blocks
    read through it are views of the map, valid until it ends."""

    def __init__(self, tier: LmdbTier, txn):
        self._tier = tier
        self._txn = txn

    def stored(self, key: bytes, start: int, unread: bool = False) -> Optional[Stored]:
        """The block's bytes, header checked (``LmdbTier.stored``: ``None`` when
        gone, ``BlockDecodeError`` when bad; ``unread``: pages read as copied)."""
        return self._tier.stored(self._txn, key, start, unread)

    def offset_of(self, buf) -> int:
        """Where a view read here lies in the file (-1: not in the map)."""
        return self._tier.offset_of(buf)


class Disk:
    """The one holder of the store's ``LmdbTier``: the rest of the store asks
    it, never the tier."""

    def __init__(self, tier: LmdbTier, table: BlockTable, counters: Counters, config: StoreConfig,
                 warn: Callable[[str, str], None]):
        self._tier = tier
        self.table = table
        self.counters = counters
        self.config = config
        self.warn = warn
        self.orphans = 0  # blocks found at open whose parent is missing (ignored)
        # what the index says of the block size: the smallest start past 0 (a second block starts one block
        # in), the longest first block (a full one is one block long)
        self._second_start: Optional[int] = None
        self._first_length = 0
        self.cleared = 0  # the store's clear count as this process last saw it (``LmdbTier.cleared``)
        self._full_at: Optional[float] = None  # when a full device last stopped writes to it

    # ------------------------------------------------------------- writes

    def write(self, entries: Iterable[tuple[BlockRef, Entry]], nbytes: Optional[int] = None) -> bool:
        """Write blocks and their records in one transaction; True when written.
        ``entries`` may be a stream (``nbytes``: about its total), copied as it
        comes; it is taken to its end whether written or not."""
        source = iter(entries)
        first = next(source, None)
        if first is None:
            return False
        pairs: list[tuple[BlockRef, Entry]] = []
        known: set[bytes] = set()  # blocks whose parent this process took for on disk (a clear may have removed it)

        def taken() -> Iterator[Entry]:
            for pair in itertools.chain((first,), source):
                pairs.append(pair)
                if self.table.on_disk(pair[0], parent=True):
                    known.add(pair[0].key)
                yield pair[1]

        if self._full_at is not None and time.monotonic() - self._full_at < self.config.tuning.full_pause_s:
            for _ in source:
                pass
            return False  # the device is full and evicting did not help: RAM only for now
        try:
            written = self._tier.store(taken(), nbytes, lambda e: e.key in known)
        except Exception as e:
            for _ in source:
                pass
            self.counters.count("write_errors")
            self.failed("writing to", e)
            if self._tier.is_full(e) and not self._shrink():
                self._full_at = time.monotonic()
            return False
        self._full_at = None
        recs = {r.key: r for r in written.records}
        self.table.disk.written([(n, recs[n.key]) for n, _ in pairs if n.key in recs])
        self.counters.count("blocks_written", len(recs))
        self.counters.count("bytes_written", sum(len(e.payload) for n, e in pairs if n.key in recs))
        if written.parentless or written.cleared != self.cleared:
            self.recheck(written.cleared, len(written.parentless))
        try:
            if self._tier.usage() > self._tier.budget:
                self.evict_to(int(self._tier.budget * self.config.tuning.evict_to))
        except Exception as e:  # the blocks are written; staying under budget is retried next write
            self.failed("evicting from", e)
        return True

    def evict_to(self, target: int) -> int:
        """Delete least recently used disk leaves until usage <= ``target``;
        a block then in no tier leaves the index."""
        gone = 0
        for _ in range(self.config.tuning.evict_rounds):
            over = self._tier.usage() - target
            if over <= 0:
                break
            victims = self.table.disk.victims(over)
            if not victims:
                break
            deleted = set(self._tier.remove([v.key for v in victims]))
            self.table.disk.left(victims, deleted)
            gone += len(deleted)
        if gone:
            self.counters.count("evictions_ssd", gone)
            log.info("kvstore: evicted %d blocks from %s to stay under its budget", gone, self._tier.path)
        return gone

    def _shrink(self) -> bool:
        """Lower the disk budget below what the full device holds and evict to
        it; False when that failed too."""
        try:
            self._tier.budget = max(0, int(self._tier.usage() * self.config.tuning.evict_to))
            self.evict_to(self._tier.budget)
            return True
        except Exception as e:
            self.failed("evicting from", e)
            return False

    def recheck(self, cleared: int, parentless: int = 0) -> None:
        """Blocks were removed under this process (a ``kvstore clear``, or
        another process evicted a parent of blocks it wrote): the blocks it
        knows on disk that are gone leave the index, with the blocks under
        them, RAM copies too, so the next put stores them again rather than
        keep them RAM-only."""
        self.cleared = cleared
        keys = self.table.disk.keys()
        try:
            with self._tier.reader() as txn:
                gone = {k for k in keys if self._tier.record(txn, k) is None}
        except Exception as e:
            self.failed("reading", e)
            return
        dropped = self.table.disk.removed(gone)
        log.info("kvstore: %s was cleared or evicted by another process: %d blocks not written (their parent was "
                 "gone), %d blocks this process knew there forgotten", self._tier.path, parentless, dropped)

    def remove_all(self) -> None:
        """Delete every block on disk (``PrefixStore.clear``; raises as the tier does)."""
        self._tier.remove_all()

    def close(self) -> None:
        """Let this store's hold on the LMDB tier go (the process's last holder closes it)."""
        self._tier.close()

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            try:
                self._tier.remove(keys)
            except Exception as e:
                self.failed("deleting from", e)

    def save(self) -> None:
        """Write last-use times, hit counts and lifetime counters."""
        uses, deltas = self.counters.drain()
        if not uses and not deltas:
            return
        try:
            self._tier.touch(uses)
            self._tier.add_counters(deltas)
        except Exception as e:
            self.counters.restore(uses, deltas)
            self.failed("updating use times in", e)

    def block_size(self, asked: Optional[int]) -> int:
        """The store's block size (call after ``load_index``): the one recorded
        at its creation. A store without the record (made before kvstore kept
        one) takes the one its blocks show, else ``asked`` (or the default),
        and records it. ``asked`` other than the store's is logged, not used:
        a block's key hashes its tokens, so blocks of another size would never
        be found again."""
        layout = self._tier.get_info("layout")
        size = layout.get("block_size") if isinstance(layout, dict) else None
        if not isinstance(size, int) or size < 1:
            want = asked or DEFAULT_BLOCK
            size = self._second_start or max(self._first_length, want)
            if not self._tier.readonly:
                try:
                    size = self._tier.set_info_once("layout", {"block_size": size})["block_size"]
                except Exception as e:  # (a full device) recorded at a later open
                    self.failed("recording the block size in", e)
        if asked is not None and asked != size:
            log.warning("kvstore: %s holds blocks of %d tokens: block_size=%d is not used for it (blocks are keyed "
                        "by their size; for another, use a new ssd_path or delete this store)", self._tier.path,
                        size, asked)
        return size

    def info(self, name: str) -> Any:
        """A record kept with the blocks (``meta``: the measured rates), ``None`` when there is none."""
        return self._tier.get_info(name)

    def set_info(self, name: str, value) -> None:
        self._tier.set_info(name, value)

    def stats(self) -> dict:
        """The disk's part of ``PrefixStore.stats()``."""
        return {"ssd_bytes": self._tier.usage(), "ssd_budget": self._tier.budget,
                "ssd_blocks": self.table.disk.blocks, "ssd_path": str(self._tier.path)}

    def models(self) -> dict[bytes, dict]:
        """The models registered in the store: root key -> description (``register_model``)."""
        return self._tier.models()

    def register_model(self, root: bytes, info: dict) -> None:
        try:
            self._tier.register_model(root, info)
        except Exception as e:  # a storage fault never reaches the engine; blocks still get stored
            self.failed("registering a model in", e)

    def failed(self, what: str, e: BaseException) -> None:
        """Log a failed disk operation once per kind; every failure of a full
        device is one kind."""
        if self._tier.is_full(e):
            self.warn("full", f"kvstore: {self._tier.path} is full; keeping new blocks in RAM only "
                              f"and evicting old ones from disk")
        else:
            self.warn(what, f"kvstore: {what} {self._tier.path} failed: {e}")

    # -------------------------------------------------------------- reads

    @contextmanager
    def reading(self) -> Iterator[DiskRead]:
        """One read transaction (``DiskRead``) for the read path: what is read through it is valid until it ends."""
        with self._tier.reader() as txn:
            yield DiskRead(self._tier, txn)

    def read_ahead(self, keys: Sequence[bytes]) -> list[Future]:
        """Start bringing these blocks into the page cache (``LmdbTier.read_ahead``);
        wait for the futures outside any read transaction (one may wait on a resize
        that waits on it)."""
        return self._tier.read_ahead(keys)

    def resident(self, spans: Mapping[bytes, tuple[int, int]]) -> dict[bytes, Optional[float]]:
        """Per block, the share of its pages in the page cache (``None``: cannot be told); reads nothing."""
        return self._tier.resident(spans)

    @property
    def data_file(self) -> Path:
        """The file the blocks live in (what the cost probe times cold reads of)."""
        return self._tier.path / "data.mdb"

    def read_failed(self, what: str, e: BaseException) -> None:
        """Warn once per ``what`` that a read failed (served as a miss, never raised)."""
        self.warn(what, f"kvstore: reading {self._tier.path} failed: {e}")

    def discover(self, node: BlockRef) -> None:
        """Index the blocks other processes wrote below ``node``."""
        found: list[BlockRecord] = []
        try:
            with self._tier.reader() as txn:
                for key in self._tier.children(txn, node.key):
                    if key not in self.table:
                        rec = self._tier.record(txn, key)
                        if rec is not None:
                            found.append(rec)
        except Exception as e:  # a fault on disk is a miss
            self.read_failed("discover", e)
        if found:
            self.table.disk.adopted(node, found)

    def on_disk(self, nodes: Sequence[BlockRef]) -> dict[bytes, BlockRecord]:
        """The records on disk of ``nodes`` (written by another process meanwhile)."""
        try:
            with self._tier.reader() as txn:
                recs = {p.key: self._tier.record(txn, p.key) for p in nodes}
        except Exception:
            return {}
        return {k: r for k, r in recs.items() if r is not None}

    def tokens(self, key: bytes) -> Optional[np.ndarray]:
        """A block's stored tokens from its record (``None`` when unreadable)."""
        try:
            with self._tier.reader() as txn:
                rec = self._tier.record(txn, key)
            return None if rec is None else rec.tokens
        except Exception:
            return None

    def load_index(self) -> None:
        """Rebuild the index from disk: every block whose parent chain is whole."""
        roots: set[bytes] = set()
        by_parent: dict[bytes, list[BlockRecord]] = {}
        bad: list[bytes] = []
        try:
            self.cleared = self._tier.cleared()  # (before the records: a clear after them is seen at the next write)
            with self._tier.reader() as txn:
                for rec in self._tier.records(txn, bad):
                    by_parent.setdefault(rec.parent, []).append(rec)
                    roots.add(rec.root)
                    if rec.start == 0:
                        self._first_length = max(self._first_length, rec.length)
                    elif self._second_start is None or rec.start < self._second_start:
                        self._second_start = rec.start
        except Exception as e:  # LMDB's own pages are corrupt
            self._tier.close()
            raise StoreOpenError(f"{self._tier.path}: the store's index cannot be read ({e}). It is corrupt: "
                                 f"move it away or delete the directory to start over.") from None
        if bad:
            log.warning("kvstore: %d blocks in %s have an unreadable index record and are ignored "
                        "(`kvstore verify --repair` removes them)", len(bad), self._tier.path)
        self.table.disk.adopt_all(by_parent, roots)
        self.orphans = sum(len(v) for v in by_parent.values())
        if self.orphans:
            log.info("kvstore: %d blocks in %s have no parent and are ignored (`kvstore verify --repair` "
                     "removes them)", self.orphans, self._tier.path)
