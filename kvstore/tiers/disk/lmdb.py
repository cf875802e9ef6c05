"""LMDB tier: blocks and the index metadata that makes them findable, on SSD.

One environment (a directory; opened, mapped and grown by ``lmdb_env``) with
sub-databases:

- ``blocks``:   block key -> serialized block (see ``header``, ``wire``)
- ``nodes``:    block key -> its ``BlockRecord`` (parent, position, tokens,
                first/last use, hits, payload bytes, offset in the file)
- ``children``: parent key -> child keys (dupsort), to find blocks other
                processes wrote and to evict leaves only
- ``models``:   root key -> what the model is (for ``kvstore inspect``)
- ``meta``:     format name and version, lifetime counters, how many times
                the store was cleared (``cleared``)

A block and its record commit in one transaction, so a reader never sees one
without the other, and a crash leaves either both or neither; and only with
its parent on disk (in that transaction), so a ``kvstore clear`` or another
process's eviction under a writer leaves no orphans. Which blocks to
write or evict is the store's decision (``disk``, ``table``); the tier only
keeps, finds and counts.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import lmdb

from ...blocks.wire import Stored
from ...errors import BlockDecodeError
from ...blocks.record import BlockRecord, Entry, Use
from ...convert.spread import pool
from .lmdb_env import LmdbEnv
from .lmdb_layout import pack, unpack
from .residency import address, can_start_writeback, prefill, resident_at, start_writeback, view_at

_PAGE_HEADER = 16  # where LMDB puts a large value in its first overflow page (64-bit builds)
_CLEARED = b"cleared"  # meta: how many times blocks were removed by a clear (``remove(..., clearing=True)``)


@dataclass
class Written:
    """What one ``store`` transaction did."""

    records: list[BlockRecord] = field(default_factory=list)  # as written (with where each value sits), in order
    # blocks not written because their parent was not on disk (removed by a clear or another process's
    # eviction since this process indexed it): a block is never indexed without its parent
    parentless: list[bytes] = field(default_factory=list)
    cleared: int = 0  # the store's clear count as of this transaction
    present: list[bytes] = field(default_factory=list)  # with ``skip_present``: blocks already stored, left as they are


class LmdbTier(LmdbEnv):
    """The blocks of one store and their records (``LmdbTier.open(path)``;
    the environment itself is ``LmdbEnv``'s). A ``Tier`` (``tiers.base``):
    ``get`` copies a block out of the map; the read path reads in place,
    inside a transaction (``stored``)."""

    name = "disk"

    def get(self, key: bytes) -> Optional[Stored]:
        with self.reader() as txn:
            rec = self.record(txn, key)
            got = None if rec is None else self.stored(txn, key, rec.start)
            return None if got is None else got.held()

    def put(self, entries: Sequence[Entry]) -> int:
        return len(self.store(entries).records)

    def contains(self, key: bytes) -> bool:
        with self.reader() as txn:
            return txn.get(key, db=self.dbs[b"nodes"]) is not None

    # ------------------------------------------------------------ blocks

    def store(self, entries: Iterable[Entry], nbytes: Optional[int] = None,
              parent_known: Optional[Callable[[Entry], bool]] = None, skip_present: bool = False) -> Written:
        """Each payload and its record in one transaction, where its parent is
        a root, on disk, or written before it here (the rest are skipped:
        ``Written.parentless``). ``parent_known``: only entries for which it
        is true are held to that (the writer took their parent for stored;
        others have their parent still to come from the writer, in a later
        transaction). ``entries`` may be a stream
        (the writer's blocks as it encodes them, ``nbytes`` about their
        total): each is copied into the map as it comes, so the disk writes
        the first while later ones are still being encoded, rather than
        waiting for a whole batch. ``skip_present``: a block already stored
        is left as it is (``Written.present``), decided in the transaction (an
        import beside engines writing the same blocks)."""
        dbs = self.dbs
        fd = os.open(self._data_file, os.O_RDWR) if self.writemap and can_start_writeback() else -1
        source, taken = iter(entries), []

        def attempt():  # a retried transaction writes again what an earlier attempt took
            yield from list(taken)
            for e in source:
                taken.append(e)
                yield e

        written = Written()

        def fn(txn):
            ahead = _Prefill(self, txn, fd) if fd >= 0 else None
            written.records, written.parentless, written.present = [], [], []
            raw = txn.get(_CLEARED, db=dbs[b"meta"])
            written.cleared = 0 if raw is None else unpack(raw)
            here: set[bytes] = set()
            for e in attempt():
                if skip_present and txn.get(e.key, db=dbs[b"nodes"]) is not None:
                    written.present.append(e.key)
                    continue
                parent = e.record.parent
                if parent != e.record.root and parent not in here and txn.get(parent, db=dbs[b"nodes"]) is None \
                        and (parent_known is None or parent_known(e)):
                    written.parentless.append(e.key)
                    continue
                here.add(e.key)
                n = len(e.payload)
                if ahead is not None:
                    ahead.before(n)
                txn.put(e.key, e.payload, db=dbs[b"blocks"])
                # with writemap a new value's pages are its pages in the file: its offset is final
                # (the get touches pages just written)
                offset = self.offset_of(txn.get(e.key, db=dbs[b"blocks"])) if self.writemap else -1
                if ahead is not None and offset >= 0:
                    ahead.after(offset, n)
                    start_writeback(fd, offset, n)  # the disk writes it while the next is copied
                rec = replace(e.record, offset=offset)
                txn.put(e.key, rec.pack(), db=dbs[b"nodes"])
                txn.put(rec.parent, e.key, db=dbs[b"children"], dupdata=True)
                written.records.append(rec)
        if nbytes is None:
            items = list(source)
            source, nbytes = iter(items), sum(len(e.payload) for e in items)
        try:
            self.write(fn, nbytes, buffers=True)
        finally:
            if fd >= 0:
                os.close(fd)
        return written

    def _free_and_end(self, txn: lmdb.Transaction) -> tuple[int, int]:
        """Bytes of the file's free pages and where LMDB's last page in use
        ends, as of the transaction's start."""
        info, psize = self.env.info(), self._psize()
        end = (info["last_pgno"] + 1) * psize
        used = 2 * psize + _pages(self.env.stat()) + sum(_pages(txn.stat(db)) for db in self.dbs.values())
        return end - used, end

    def remove(self, keys: Sequence[bytes], clearing: bool = False) -> list[bytes]:
        """Remove blocks and their records; returns the keys that were there.
        ``clearing``: count a clear in the same transaction, so engines with
        the store open learn of it at their next write (``cleared``)."""
        done: list[bytes] = []
        dbs = self.dbs

        def fn(txn):
            done.clear()
            if clearing:
                raw = txn.get(_CLEARED, db=dbs[b"meta"])
                txn.put(_CLEARED, pack((0 if raw is None else unpack(raw)) + 1), db=dbs[b"meta"])
            for key in keys:
                raw = txn.get(key, db=dbs[b"nodes"])
                if raw is None and txn.get(key, db=dbs[b"blocks"]) is None:
                    continue
                rec = None if raw is None else BlockRecord.unpack(key, raw)
                txn.delete(key, db=dbs[b"blocks"])
                txn.delete(key, db=dbs[b"nodes"])
                txn.delete(key, db=dbs[b"children"])
                if rec is not None:
                    txn.delete(rec.parent, key, db=dbs[b"children"])
                done.append(key)
        self.write(fn)
        return done

    def touch(self, uses: Mapping[bytes, Use]) -> None:
        """Record last-use times and hit counts."""
        nodes = self.dbs[b"nodes"]

        def fn(txn):
            for key, use in uses.items():
                raw = txn.get(key, db=nodes)
                rec = None if raw is None else BlockRecord.unpack(key, raw)
                if rec is not None:
                    txn.put(key, rec.used_now(use.when, use.hits).pack(), db=nodes)
        if uses:
            self.write(fn)

    def usage(self) -> int:
        """Bytes in use by every database, from LMDB's own page counts."""
        with self.reader() as txn:
            total = _pages(self.env.stat())
            for db in self.dbs.values():
                total += _pages(txn.stat(db))
        return total

    # ------------------------------------------------------------------ reads

    def payload(self, txn: lmdb.Transaction, key: bytes):
        """A block's bytes: a view of the map, valid inside ``txn`` only."""
        return txn.get(key, db=self.dbs[b"blocks"])

    def stored(self, txn: lmdb.Transaction, key: bytes, start: int, unread: bool = False) -> Optional[Stored]:
        """A block's bytes with its header checked and bound to ``key`` (its
        payload is not checked yet: ``Stored.intact``), or ``None`` when it is
        not there; raises ``BlockDecodeError`` (with the reason) when what is
        there is not a good block of ``key``. Valid inside ``txn`` only.

        ``unread``: without reading the payload yet. py-lmdb's ``get`` reads
        every page of a value before it returns, so a cold hit read all its
        blocks before the first was copied; here the view is taken where the
        block's record (written in the same transaction as the value) says
        its bytes lie, and its pages are read as they are copied, while the
        next ones are still on their way. Where the record has no offset, or
        the bytes there are not this block's, the value is read as above.
        kvstore writes a value and its record in one transaction, and LMDB
        never moves a large value it does not rewrite; a value rewritten
        through LMDB by another program, its record left as it was, is read
        from its old pages (its key and checksum still decide: a page reused
        meanwhile fails the checksum and the block is dropped, never served)."""
        if unread:
            got = self._stored_unread(txn, key, start)
            if got is not None:
                return got
        buf = self.payload(txn, key)
        return None if buf is None else Stored.of(buf, key, start)

    def _stored_unread(self, txn: lmdb.Transaction, key: bytes, start: int) -> Optional[Stored]:
        span = self._map_span()
        rec = self.record(txn, key) if span is not None else None
        if rec is None or rec.offset < 0 or rec.offset + rec.nbytes > min(span[1] - span[0], self._file_size()):
            return None  # (past the file's end a mapped page is a SIGBUS, not an error)
        psize = self._psize()
        if rec.nbytes < psize or rec.offset % psize != _PAGE_HEADER:
            # only a value on pages of its own (LMDB's overflow pages, 16 bytes into the first) stays where it
            # was written; a small one lives in a leaf page that later writes copy elsewhere
            return None
        try:
            return Stored.of(view_at(span[0] + rec.offset, rec.nbytes), key, start)
        except BlockDecodeError:
            return None  # not this block's bytes (a store copied elsewhere): LMDB knows where they are

    def record(self, txn: lmdb.Transaction, key: bytes) -> Optional[BlockRecord]:
        """The block's index record; ``None`` when missing or malformed."""
        raw = txn.get(key, db=self.dbs[b"nodes"])
        return None if raw is None else BlockRecord.unpack(key, raw)

    def children(self, txn: lmdb.Transaction, key: bytes) -> list[bytes]:
        cur = txn.cursor(db=self.dbs[b"children"])
        if not cur.set_key(key):
            return []
        return [bytes(k) for k in cur.iternext_dup()]

    def offset_of(self, buf) -> int:
        """A value's offset in the file from a view of it (-1 when not in the map)."""
        span = self._map_span()
        addr = address(buf)
        return addr - span[0] if span is not None and span[0] <= addr < span[1] else -1

    def read_ahead(self, keys: Sequence[bytes]) -> list[Future]:
        """Start bringing values into the page cache, in order, from worker
        threads; returns their futures. py-lmdb's ``get`` touches every page
        of the value it returns, with the GIL released: one ``get`` per thread
        is one sequential read, so a cold hit is read by several streams, and
        the caller copies the first blocks while later ones are read (a page
        it reaches first waits for the read under way)."""
        blocks = self.dbs[b"blocks"]

        def one(key: bytes) -> None:
            with self.reader() as txn:
                txn.get(key, db=blocks)

        # threads of its own: a worker waiting here for a resize must never hold up a hit's gather
        # (on the shared pool) that holds the reader the resize waits for
        ahead = pool("readahead")
        return [ahead.submit(one, k) for k in keys]

    def resident(self, spans: Mapping[bytes, tuple[int, int]]) -> dict[bytes, Optional[float]]:
        """Per block (by its ``(offset, nbytes)`` in the file, from its record),
        the fraction of its pages in the page cache, ``None`` where that cannot
        be told: a page-cached read and a cold one differ several-fold, and
        the cost model needs to know which it faces. Reads nothing."""
        out: dict[bytes, Optional[float]] = {k: None for k in spans}
        with self._gate.shared():  # no remap meanwhile
            base = self._map_span() if any(off >= 0 for off, _ in spans.values()) else None
            if base is None:
                return out
            for key, (off, n) in spans.items():
                if off >= 0 and base[0] + off + n <= base[1]:
                    out[key] = resident_at(base[0] + off, n)
        return out

    def records(self, txn: lmdb.Transaction, bad: Optional[list] = None) -> Iterator[BlockRecord]:
        """Every well-formed index record; keys of malformed ones go to ``bad``
        (``own_pages_only`` meanwhile: no blocks read around the index's pages)."""
        with self.own_pages_only():
            for k, v in txn.cursor(db=self.dbs[b"nodes"]):
                rec = BlockRecord.unpack(bytes(k), v)
                if rec is None:
                    if bad is not None:
                        bad.append(bytes(k))
                    continue
                yield rec

    def models(self) -> dict[bytes, dict]:
        with self.reader() as txn:
            return {bytes(k): unpack(v) for k, v in txn.cursor(db=self.dbs[b"models"])}

    def get_counters(self) -> dict:
        return self.get_info("counters") or {}

    # ----------------------------------------------------------------- writes

    def register_model(self, root: bytes, info: dict) -> None:
        def fn(txn):
            if txn.get(root, db=self.dbs[b"models"]) is None:
                txn.put(root, pack(info), db=self.dbs[b"models"])
        self.write(fn)

    def add_counters(self, counters: Mapping[str, int]) -> None:
        """Add to the store's lifetime counters."""
        def fn(txn):
            raw = txn.get(b"counters", db=self.dbs[b"meta"])
            total = unpack(raw) if raw is not None else {}
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
            txn.put(b"counters", pack(total), db=self.dbs[b"meta"])
        if counters:
            self.write(fn)

    def remove_all(self, root: Optional[bytes] = None) -> int:
        """Delete every block (of one root key, if given). Returns how many."""
        bad: list[bytes] = []
        with self.reader() as txn:
            keys = [r.key for r in self.records(txn, bad) if root is None or r.root == root]
        return len(self.remove(keys + (bad if root is None else []), clearing=True))

    def cleared(self) -> int:
        """How many times blocks were removed by a clear (0 for a store never cleared)."""
        return self.get_info(_CLEARED.decode()) or 0


def _pages(stat: dict) -> int:
    return stat["psize"] * (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"])


class _Prefill:
    """Puts in place the page cache of the pages each value of a write will
    take, just before it is copied, where that is known: when the file's free
    pages could not hold it, LMDB takes new pages past the last one in use
    (which hold nothing: zeros are written there, ``residency.prefill``).
    Where they could (after evictions), LMDB may reuse those instead: left
    alone then. Value by value rather than a whole batch first, so the first
    copy, and the disk's first write, do not wait for the rest."""

    _SLACK = 1 << 20  # past a value: the few leaf and branch pages a put takes besides

    def __init__(self, tier: LmdbTier, txn: lmdb.Transaction, fd: int):
        self.fd = fd
        self.free, self.at = tier._free_and_end(txn)  # at: where the next appended value starts (about)
        self.done = self.at  # prefilled up to here
        self.psize = tier._psize()
        # never past the map or the file (a write there would grow the file): neither changes during the
        # transaction, since a resize waits for it on the gate
        self.limit = min(tier.env.info()["map_size"], tier._file_size())

    def before(self, n: int) -> None:
        if self.free >= n:
            self.free -= n  # (it may take free pages: counted as taken)
            return
        stop = min(self.at + n + self.psize + self._SLACK, self.limit)
        if stop > self.done:
            prefill(self.fd, self.done, stop - self.done)
            self.done = stop

    def after(self, offset: int, n: int) -> None:
        """A value now lies at ``[offset, offset + n)``: nothing at or before
        its end, nor the few pages LMDB takes right after it, is zeroed later
        (a value that went where no prefill was, appended after all, moves
        the prefilled end past it)."""
        self.at = max(self.at, offset + n)
        self.done = max(self.done, self.at + self._SLACK)
