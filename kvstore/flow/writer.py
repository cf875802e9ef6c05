"""The background writer: encodes the blocks a ``put`` queued (slice, quantize, serialize out of the engine's buffers:
one copy, to host memory on every backend), admits those bytes to RAM and writes the same bytes through to disk in
large transactions on the commit thread (``commit``): the next batch is encoded while one is written.

``put`` only hashes, indexes and queues, so the engine waits well under a millisecond; blocks another process wrote
meanwhile are found here, not on the engine's thread. The queue is bounded by the bytes of the engine's arrays that
queued puts keep alive (a job lets go of them once encoded): past the bound a put is skipped whole, never done on
the engine's thread and never kept in part (a prefix cache may keep less under a burst; it must not make the engine
wait), unless it takes over queued puts of shorter prompts it starts with (a conversation's earlier turns): their
blocks become its own and their arrays are let go. The writer runs its device work on a stream of its own and waits
between blocks while an engine call runs (``priority``). The writer owns every put it was handed until it is done
(``Job``, known elsewhere by its id alone): the table marks a put's blocks with that id until each is durable where
it is going (RAM for a RAM-only store, disk otherwise), and a fetch that needs a block not in RAM asks the writer
for the put's rows (``queued_rows``) or waits for it (``wait``).

With a remote tier, each batch is offered to its write-behind queue after the local write. A job of blocks read from
the remote (``found``) is only kept locally: nothing to encode, nothing to send back.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..background import running
from ..gpu import buffers
from ..blocks.codec import Codec
from .commit import Committer, Feed, settle
from ..config import StoreConfig
from ..counters import Counters
from .disk import Disk
from ..convert.encode import About, Rows, encoded
from ..state.index import BlockRef
from ..convert.queued import plain, rows_of_queued
from ..state.plans import Placed
from ..blocks.layers import Layer
from .priority import EngineFirst
from ..blocks.record import BlockRecord, Entry
from ..gpu.backend import Backend
from ..state.table import BlockTable
from ..blocks.wire import Stored

if TYPE_CHECKING:
    from ..tiers.remote.sync import Remote

log = logging.getLogger("kvstore")


_IDS = itertools.count(1)


@dataclass
class Job:
    """Blocks of one ``put`` (or one remote read) waiting for the writer: its own, never handed out (the rest
    of the store knows it by ``ident``)."""

    nodes: Optional[Sequence[BlockRef]]  # its blocks, as the table handed them out (a put's: taken when run)
    root: bytes
    tokens: np.ndarray
    layers: list[Layer]
    nbytes: int  # of the layers' rows (what encoding has to go through)
    done: threading.Event = field(default_factory=threading.Event)
    found: Optional[dict[bytes, Entry]] = None  # blocks read from the remote tier, already encoded
    compressed: dict[int, Rows] = field(default_factory=dict)  # per layer: rows compressed at once
    # of the arrays it keeps alive until done (an engine's buffers whole, spare rows included): what the queue
    # bound counts (None: ``nbytes``)
    held: Optional[int] = None
    holding: bool = False  # counted in the writer's pending bytes (queued, not yet encoded)
    unadmitted: set[bytes] = field(default_factory=set)  # blocks kept in RAM only, until reused (not written)
    count: int = 0  # its blocks (before ``nodes`` is taken)
    ident: int = field(default_factory=lambda: next(_IDS))

    def __post_init__(self) -> None:
        if self.held is None:
            self.held = self.nbytes


class Writer:
    def __init__(self, table: BlockTable, disk: Optional[Disk], codec: Codec, counters: Counters,
                 config: StoreConfig, on_idle: Callable[[], None], remote: Optional["Remote"] = None,
                 engine: Optional[EngineFirst] = None, backend: Optional[Backend] = None):
        self.table = table
        self.backend = backend  # the store's (``gpu.backend``; None: chosen at each encode)
        self.engine = engine if engine is not None else EngineFirst(config.tuning.writer_patience_s)
        self.disk = disk if disk is not None and not config.readonly else None
        self.remote = remote
        self.codec = codec
        self.counters = counters
        self.config = config
        self.max_pending = config.pending_bound()
        self.on_idle = on_idle  # after each job (saves use times)
        self.lock = threading.Lock()  # guards pending_bytes and the thread (nothing of the table's)
        self.pending_bytes = 0
        self._queue: "queue.Queue[Union[Job, Callable[[], None], None]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._committer = Committer()
        self._pid = os.getpid()
        self._pending: dict[int, Job] = {}  # the puts handed to it and not done, by id

    @property
    def pending_jobs(self) -> int:
        return self._queue.qsize()

    def register(self, job: Job) -> int:
        """Own ``job`` from now on; returns its id, what the table marks its blocks with. Registered before the
        table sees the id, so a fetch that finds it can always ask for the job (``submit`` queues it)."""
        self._pending[job.ident] = job
        return job.ident

    def register_put(self, count: int, root: bytes, tokens: np.ndarray, layers: list[Layer], held: int) -> int:
        """``register`` a put's job of ``count`` new blocks (``held``: bytes of the arrays it keeps alive)."""
        return self.register(Job(None, root, tokens, layers, sum(l.nbytes for l in layers), held=held, count=count))

    def register_copies(self, nodes: Sequence[BlockRef], root: bytes, tokens: np.ndarray,
                        entries: dict[bytes, Entry]) -> int:
        """``register`` the disk copies of blocks read from the remote (encoded already: only kept locally)."""
        return self.register(Job(nodes, root, tokens, [], sum(len(e.payload) for e in entries.values()),
                                 found=entries))

    def submit(self, pending: int) -> int:
        """Queue the registered put ``pending``; never run it here. Past the
        bound (queued jobs keep more than ``max_pending`` bytes of arrays
        alive) the put is skipped whole: its blocks leave the index as if
        never put, and it is counted (``puts_skipped``, ``blocks_skipped``).
        Returns how many blocks were queued (0 when skipped). Call without the
        store lock."""
        job = self._pending.get(pending)
        if job is None:
            return 0
        with self.lock:
            if self._pid != os.getpid():  # a forked child: the parent's queued jobs are the parent's to write
                self._pid, self.pending_bytes = os.getpid(), 0
            skip = self._hold(job)
        if skip:
            skip = not self._supersede(job)
        count = job.count or len(job.nodes or ())
        if skip:
            self.counters.count("puts_skipped")
            self.counters.count("blocks_skipped", count)
            self._drop(job)
            return 0
        if not self._queued(job):
            self.run(job)  # no thread can start (an interpreter exiting, Python 3.12+): done here
        return count

    def _hold(self, job: Job) -> bool:
        """Count ``job``'s arrays against the bound; True (not counted) where they would pass it. Under the lock."""
        if self.pending_bytes > 0 and self.pending_bytes + job.held > self.max_pending:
            return True
        self.pending_bytes += job.held
        job.holding = True
        return False

    def _supersede(self, job: Job) -> bool:
        """Queued puts of shorter prompts ``job``'s starts with (a conversation's earlier turns, in a burst) hand
        their blocks over to it, whose arrays hold their rows too, and let go of their own arrays; then ``job``
        is held if it fits. Plain KV only: a state snapshot or a window is valid at its own length alone."""
        if job.found is not None or not plain(job.layers):
            return False
        n = len(job.tokens)
        older = [o for o in list(self._pending.values()) if o is not job and o.holding and o.found is None
                 and o.root == job.root and len(o.tokens) <= n and plain(o.layers)
                 and np.array_equal(o.tokens, job.tokens[: len(o.tokens)])]
        moved = set(self.table.hand_over([o.ident for o in older], job.ident)) if older else set()
        with self.lock:
            for o in older:
                if o.ident in moved and o.holding:
                    o.holding, o.layers, o.compressed = False, [], {}
                    self.pending_bytes -= o.held
                    job.count += o.count
            fits = not self._hold(job)
        if moved:
            self.counters.count("puts_superseded", len(moved))
        return fits

    # ------------------------------------------------- what a fetch asks of a put not yet stored

    def wait(self, pending: Sequence[int]) -> None:
        """Until these puts are done (stored, or dropped)."""
        for pid in pending:
            job = self._pending.get(pid)
            if job is not None:
                job.done.wait()

    def queued_rows(self, pending: Sequence[int], tokens: np.ndarray, start: int, length: int
                    ) -> Optional[list[Layer]]:
        """Rows ``[start, length)`` of a put still queued whose prompt starts with ``tokens[:length]``, as a read
        of them once stored gives them (``queued.rows_of_queued``); None when none can give them."""
        jobs = [j for pid in pending if (j := self._pending.get(pid)) is not None]
        return rows_of_queued(jobs, tokens, start, length, self.codec)

    def tokens(self, pending: int, start: int, stop: int) -> Optional[np.ndarray]:
        """Tokens ``[start, stop)`` of a put still queued (a block's, found before it is stored)."""
        job = self._pending.get(pending)
        return None if job is None else job.tokens[start:stop]

    def _drop(self, job: Job) -> None:
        """A job not stored: its blocks leave the index (a later put stores them)."""
        nodes = self._nodes(job)
        self.table.put_done(job.ident, nodes, dropped=True)
        self.table.put_released(job.ident, nodes)
        self._let_go(job)
        self._done(job)

    def _nodes(self, job: Job) -> Sequence[BlockRef]:
        if job.nodes is None:  # (a put's: its refs are made here, on the writer's thread)
            job.nodes = self.table.new_refs(job.ident)
        return job.nodes

    def _done(self, job: Job) -> None:
        job.done.set()
        self._pending.pop(job.ident, None)

    def _let_go(self, job: Job) -> None:
        """The job is done with the engine's arrays: they no longer count against the bound."""
        job.layers, job.compressed = [], {}
        with self.lock:
            if job.holding:
                job.holding = False
                self.pending_bytes -= job.held

    def later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread after the jobs queued before it
        (a small write that should not block the caller on an fsync)."""
        if not self._queued(fn):
            fn()

    def _queued(self, item: Union[Job, Callable[[], None]]) -> bool:
        """Put ``item`` on the writer thread's queue, starting the thread
        when it is not running; False where no thread can start."""
        try:
            self.start()
        except RuntimeError:
            return False
        self._queue.put(item)
        return True

    def admit(self, leaves: list[BlockRef]) -> None:
        """Queue the admission to disk of the chains of ``leaves`` held in RAM
        only (``ssd_admit="reuse"``): claimed when the writer gets to it, after
        the puts queued before, so their blocks are in RAM by then."""
        def run() -> None:
            pid = self.table.admissions.claim(leaves, lambda nodes, entries: self.register(Job(
                nodes, entries[nodes[0].key].record.root, np.zeros(0, np.int32), [],
                sum(len(e.payload) for e in entries.values()), found=entries, held=0)))
            if pid:
                self.run(self._pending[pid])

        self.later(run)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued job is done."""
        if self._thread is None or not self._thread.is_alive():
            return
        if timeout is None:
            self._queue.join()
            return
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
        self._committer.stop()

    def start(self) -> None:
        """Start the writer thread (again, if it is not running: not yet, or
        in a forked child, where the parent's threads are gone). A thread
        starts on a queue of its own: a queue a parent's thread waited on
        would hand the next item to that thread, which does not exist here.
        Raises ``RuntimeError`` where no thread can start."""
        with self.lock:
            self._thread, self._queue = running(self._thread, self._queue, self._loop, "kvstore-writer")

    def _loop(self, jobs: "queue.Queue") -> None:
        # a stream of its own: the writer's kernels and copies never queue behind or in front of an engine's
        with mx.stream(mx.new_stream(mx.default_device())):
            while True:
                job = jobs.get()
                try:
                    if job is None:
                        return
                    if isinstance(job, Job):
                        self.run(job)
                    else:
                        job()  # from later()
                except Exception:  # the writer lives on: the next put's blocks still get stored
                    log.exception("kvstore: a background write failed")
                finally:
                    job = None  # (not kept while waiting: a job holds the engine's arrays)
                    jobs.task_done()

    # ------------------------------------------------------------- one job

    def run(self, job: Job) -> None:
        """Encode the job's blocks into RAM and write them through."""
        t0 = time.perf_counter()
        try:
            self._run(job)
        finally:
            self.counters.count("writer_us", int((time.perf_counter() - t0) * 1e6))
            self.on_idle()  # (after the count: it saves the counters)

    def _run(self, job: Job) -> None:
        self._nodes(job)
        cfg = self.config
        to_disk = self.disk is not None
        to_remote = self.remote is not None and job.found is None
        feed: Optional[Feed] = None  # blocks of the write transaction being filled
        writing: list[Future] = []  # one per transaction, on the commit thread, in order
        # about what is still to come, to make room by: the exact bytes of blocks read from the remote, else
        # the new blocks' share of the engine's bytes
        left = job.nbytes if job.found is not None else \
            job.nbytes * sum(n.length for n in job.nodes) // max(1, len(job.tokens))
        try:
            elsewhere = self._written_elsewhere(job) if to_disk and job.found is None else set()
            for node, entry in self._entries(job, elsewhere, to_disk, to_remote):
                n = len(entry.payload)
                if feed is None:
                    feed = Feed(cfg.tuning.write_ahead_bytes)
                    writing.append(self._commit(feed, job, to_disk, to_remote,
                                                min(cfg.tuning.write_batch_bytes + n, max(left, n))))
                feed.put((node, entry), n)
                left -= n
                if feed.nbytes >= cfg.tuning.write_batch_bytes or time.monotonic() - feed.opened >= cfg.tuning.write_seconds:
                    feed, full = None, feed
                    full.close()
            self._let_go(job)  # encoded: the next put may queue while this one's blocks are written
            if feed is not None:
                feed, last = None, feed
                last.close()
            for w in writing:
                w.result()
        except BaseException as e:  # an error, or an interrupt of a put run in the engine's thread
            if feed is not None:  # (the commit thread must not wait on it, holding LMDB's write lock)
                feed, failed = None, feed
                failed.close()
            wait(writing)  # their outcome is settled before blocks are dropped
            if isinstance(e, Exception):
                log.exception("kvstore: storing %d blocks failed; they are dropped", len(job.nodes))
            self.table.put_done(job.ident, job.nodes, dropped=True)  # (in no tier, a later put would take them as stored)
            if not isinstance(e, Exception):
                raise
        finally:
            self._let_go(job)
            self.table.put_released(job.ident, job.nodes)
            self._done(job)

    def _entries(self, job: Job, elsewhere: set[bytes], to_disk: bool, to_remote: bool
                 ) -> Iterator[tuple[BlockRef, Entry]]:
        """The job's blocks to write, in order: encoded and admitted to RAM
        first (blocks read from the remote come as they were read). Skips
        blocks on disk already and those no longer the job's (dropped
        meanwhile: an evicted parent, a clear; or re-encoded by a later put)."""
        if job.found is not None:
            if to_disk:
                yield from ((n, e) for n in job.nodes if (e := job.found.get(n.key)) is not None
                            and n.key not in elsewhere and self.table.is_pending(n, job.ident))
            return

        def wanted(n: BlockRef) -> bool:
            return n.key not in elsewhere and self.table.is_pending(n, job.ident)

        for node, held, about in encoded(job, self.codec, self.config.tuning.compress_rows, wanted,
                                              backend=self.backend):
            self.engine.yield_to_engine()
            record = self._record(job, node, held, about) if to_disk or to_remote else None
            where = self.table.encoded(node, job.ident, held, ram_only=not to_disk, record=record)
            if where is Placed.NOT_KEPT:  # kept nowhere: its buffer is for the next block (page-locked memory is slow to make)
                buffers.give_back(held.buf)
                continue
            self.counters.count("blocks_stored")
            if where is Placed.RAM_ONLY:  # in RAM until asked for again (ssd_admit="reuse")
                job.unadmitted.add(node.key)
                if not to_remote:
                    continue
            if record is not None:
                yield node, Entry(record, held.buf)

    def _written_elsewhere(self, job: Job) -> set[bytes]:
        """Keys of the job's blocks another process wrote to disk meanwhile,
        as this put would write them: indexed as on disk, not encoded again."""
        recs = self.disk.on_disk(job.nodes)
        same = [(n, r) for n in job.nodes if (r := recs.get(n.key)) is not None
                and r.snap == n.snap and r.gap == n.gap and (not r.gap or r.first_row == n.rows_from)]
        if same:
            self.table.disk.written(same)
            self.table.put_released(job.ident, [n for n, _ in same])
        return {n.key for n, _ in same}

    def _record(self, job: Job, node: BlockRef, held: Stored, about: About) -> BlockRecord:
        now = time.time()
        return BlockRecord(key=node.key, parent=node.parent, root=job.root, start=node.start,
                           length=node.length, tokens=held.tokens.copy(), nbytes=held.nbytes, first=node.first,
                           snap=None if node.snap is None else about.has_state, gap=node.gap,
                           rows_from=node.rows_from if node.gap else -1, created=now, used=now, kv=about.kv,
                           dtype=about.dtype)

    def _commit(self, feed: "Feed", job: Job, to_disk: bool, to_remote: bool, nbytes: int) -> Future:
        """``_keep`` of a feed on the commit thread, while it is filled; where
        no thread can be started (an interpreter exiting, Python 3.12+), the
        feed holds what it is given, unbounded, and is written once complete,
        by whoever closes it (the writer)."""
        try:
            return self._committer.submit(self._keep, feed, job, to_disk, to_remote, nbytes)
        except RuntimeError:
            done: Future = Future()
            feed.ahead = None
            feed.on_close = lambda: settle(done, self._keep, feed, job, to_disk, to_remote, nbytes)
            return done

    def _keep(self, feed: "Feed", job: Job, to_disk: bool, to_remote: bool, nbytes: int) -> None:
        """On the commit thread: the local write of one transaction's blocks,
        copied as the writer hands them over, then the copies for the remote
        tier (queued)."""
        try:
            if to_disk:
                self._write(feed, job, nbytes)
            for _ in feed:  # (all of it, when there is no disk write to take it)
                pass
        finally:
            feed.abandon()  # whatever happened here, the writer never waits on this feed again
        batch = feed.taken
        if to_remote:
            self.remote.offer([e for _, e in batch])
        for (_, e), in_ram in zip(batch, self.table.in_ram([n for n, _ in batch])):
            if not in_ram:  # written through: its bytes are for the next block (once the remote sent them)
                buffers.give_back(e.payload)

    def _write(self, feed: Feed, job: Job, nbytes: int) -> None:
        """Write a transaction's blocks as they come (blocks already on disk
        are skipped, unless re-encoded with a state snapshot); then blocks in
        neither tier leave the index (the write failed and RAM could not
        hold them)."""
        self.disk.write(((n, e) for n, e in feed if n.key not in job.unadmitted
                         and (e.record.snap or not self.table.on_disk(n))), nbytes)
        self.table.put_done(job.ident, [n for n, _ in feed.taken])
