"""The background writer: encodes the blocks a ``put`` queued (slice,
quantize, serialize out of the engine's buffers: one copy, to host memory on
every backend), admits those bytes to RAM and writes the same bytes through
to disk in large transactions, on a commit thread of its own: the next batch
is encoded while one is written.

``put`` only hashes, indexes and queues, so the engine waits well under a
millisecond. The queue is bounded by bytes: past the bound a put is done in
the caller rather than queued without limit. A block's ``job`` stays set until
the block is durable where it is going (RAM for a RAM-only store, disk
otherwise): a fetch that needs a block not in RAM waits for its job.

With a remote tier, each batch is offered to its write-behind queue after
the local write. A job of blocks read from the remote (``found``) is only
kept locally: nothing to encode, nothing to send back.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import mlx.core as mx
import numpy as np

from . import buffers, cuda
from .codec import Block, Codec, block_arrays
from .wire import Stored
from .counters import Counters
from .errors import StorageError
from .index import Node
from .layers import KVLayer, Layer, StateLayer, Tensor, take_rows, tensor_rows
from .persist import Persist
from .placement import Placement
from .record import BlockRecord
from .tiers.base import Entry

if TYPE_CHECKING:
    from .remote_sync import Remote

log = logging.getLogger("kvstore")

# Bytes per disk write transaction. Each commit waits for the disk to finish its last block, and the next
# transaction's first copy waits for the commit: ~20 ms of idle disk and writer per commit on the 2-core box
# (a 256 MiB put went from ~150 ms in two transactions to ~110 ms in one; a plain write+fsync: ~118 ms).
WRITE_BATCH = 512 << 20
WRITE_AHEAD = 64 << 20  # bytes encoded and not yet taken by the transaction being written
# and seconds: the transaction holds LMDB's write lock (other processes' writes wait) while blocks are encoded
WRITE_SECONDS = 1.0


@dataclass
class Job:
    """Blocks of one ``put`` waiting for the writer."""

    nodes: list[Node]
    root: bytes
    tokens: np.ndarray
    layers: list[Layer]
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    found: Optional[dict[bytes, Entry]] = None  # blocks read from the remote tier, already encoded
    # per layer, rows [start, stop) compressed at once for the blocks inside them: (start, stop, keys, values)
    compressed: dict[int, tuple[int, int, Tensor, Tensor]] = field(default_factory=dict)


class Writer:
    def __init__(self, placement: Placement, persist: Optional[Persist], codec: Codec, lock, counters: Counters,
                 max_pending: int, on_idle: Callable[[], None], remote: Optional["Remote"] = None):
        self.placement = placement
        self.remote = remote
        self.persist = persist
        self.codec = codec
        self.lock = lock
        self.counters = counters
        self.max_pending = max_pending
        self.on_idle = on_idle  # after each job (saves use times)
        self.pending_bytes = 0
        self._queue: "queue.Queue[Union[Job, Callable[[], None], None]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._committer = Committer()
        self._pid = os.getpid()

    @property
    def pending_jobs(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        """Queue a job, or run it here when the queue is full (its bytes
        already over the bound). Call without the store lock."""
        with self.lock:
            if self._pid != os.getpid():  # a forked child: the parent's queued jobs are the parent's to write
                self._pid, self.pending_bytes = os.getpid(), 0
            inline = self.pending_bytes > 0 and self.pending_bytes + job.nbytes > self.max_pending
            if not inline:
                self.pending_bytes += job.nbytes
        if inline:
            self.counters.count("puts_inline")
            self.run(job)
            return
        if not self._queued(job):
            try:  # no thread can start (an interpreter exiting, Python 3.12+): done here
                self.run(job)
            finally:
                with self.lock:
                    self.pending_bytes -= job.nbytes

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
            if self._thread is None or not self._thread.is_alive():
                jobs: "queue.Queue[Union[Job, Callable[[], None], None]]" = \
                    queue.Queue() if self._thread is not None else self._queue
                thread = threading.Thread(target=self._loop, args=(jobs,), name="kvstore-writer", daemon=True)
                thread.start()
                self._thread, self._queue = thread, jobs

    def _loop(self, jobs: "queue.Queue") -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                if isinstance(job, Job):
                    try:
                        self.run(job)
                    finally:
                        with self.lock:
                            self.pending_bytes -= job.nbytes
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
        to_disk = self.persist is not None and self.placement.writable
        to_remote = self.remote is not None and job.found is None
        pl = self.placement
        feed: Optional[Feed] = None  # blocks of the write transaction being filled
        writing: list[Future] = []  # one per transaction, on the commit thread, in order
        # about what is still to come, to make room by: the exact bytes of blocks read from the remote, else
        # the new blocks' share of the engine's bytes
        left = job.nbytes if job.found is not None else \
            job.nbytes * sum(n.length for n in job.nodes) // max(1, len(job.tokens))
        try:
            for node in job.nodes:
                if not self._current(node, job):
                    continue  # dropped meanwhile (evicted parent, clear) or re-encoded by a later put
                found = job.found.get(node.key) if job.found is not None else None
                if found is None:
                    block = encode(job, node, self.codec)
                    held = Stored.pack(block, node.key, node.start)  # RAM, disk and remote keep these bytes
                    payload = held.buf
                with self.lock:
                    if not self._current(node, job):
                        continue
                    if found is None:  # (found blocks went into RAM when they were read, as far as they fit)
                        if pl.admit_locked(node, held) and not to_disk:
                            node.job = None  # durable where it goes: servable without waiting
                        elif not to_disk:
                            pl.forget_locked(node)  # fits in neither tier
                            continue
                        self.counters.count("blocks_stored")
                if to_disk or to_remote:
                    entry = found
                    if entry is None:
                        entry = Entry(self._record(job, node, block), None)  # the arrays go now
                        entry.payload = payload
                        entry.record = replace(entry.record, nbytes=len(payload))
                    n = len(entry.payload)
                    if feed is None:
                        feed = Feed(WRITE_AHEAD)
                        writing.append(self._commit(feed, job, to_disk, to_remote, min(WRITE_BATCH + n, max(left, n))))
                    feed.put((node, entry), n)
                    left -= n
                    if feed.nbytes >= WRITE_BATCH or time.monotonic() - feed.opened >= WRITE_SECONDS:
                        feed, full = None, feed
                        full.close()
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
            with self.lock:  # (indexed in no tier, a later put would take them as stored)
                for node in job.nodes:
                    if self._current(node, job) and not node.in_ram and not node.on_disk:
                        pl.forget_locked(node)
            if not isinstance(e, Exception):
                raise
        finally:
            job.compressed.clear()
            with self.lock:
                for node in job.nodes:
                    if node.job is job:
                        node.job = None
            job.done.set()
            self.on_idle()

    def _current(self, node: Node, job: Job) -> bool:
        return self.placement.index.get(node.key) is node and node.job is job

    def _record(self, job: Job, node: Node, block: Block) -> BlockRecord:
        kv, dtype = block.describe()
        now = time.time()
        has_state = any(isinstance(l, StateLayer) for l in block.layers)
        return BlockRecord(key=node.key, parent=node.parent.key, root=job.root, start=node.start,
                           length=node.length, tokens=block.tokens, nbytes=0, first=node.first,
                           snap=None if node.snap is None else has_state, gap=node.gap,
                           rows_from=node.rows_from if node.gap else -1, created=now, used=now, kv=kv, dtype=dtype)

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
            feed.on_close = lambda: _settle(done, self._keep, feed, job, to_disk, to_remote, nbytes)
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
        for node, e in batch:
            if not node.in_ram:  # written through: its bytes are for the next block (once the remote sent them)
                buffers.give_back(e.payload)

    def _write(self, feed: "Feed", job: Job, nbytes: int) -> None:
        """Write a transaction's blocks as they come (blocks already on disk
        are skipped, unless re-encoded with a state snapshot); then blocks in
        neither tier leave the index."""
        self.persist.write(((n, e) for n, e in feed if not n.on_disk or e.record.snap), nbytes)
        with self.lock:
            for node, _ in feed.taken:
                if self.placement.index.get(node.key) is not node:
                    continue
                if node.job is job:
                    node.job = None
                if not node.in_ram and not node.on_disk:
                    self.placement.forget_locked(node)  # the write failed and RAM could not hold it


class Committer:
    """The commit thread: write transactions, one after another, each taking
    its blocks from a ``Feed`` while the writer thread fills it. A thread of
    its own rather than an executor's: executors refuse work once the
    interpreter is exiting, and the store's exit hook still writes every
    pending block through it. It ends after a few idle seconds (it holds
    nothing of the store, so a store dropped unclosed is still collected)."""

    IDLE = 5.0

    def __init__(self):
        self._jobs: "queue.Queue[Optional[tuple[Future, Callable, tuple]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        done: Future = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # (not yet, idle, or a forked child)
                jobs: "queue.Queue" = queue.Queue()  # of its own: see Writer.start
                thread = threading.Thread(target=self._loop, args=(jobs,), name="kvstore-commit", daemon=True)
                thread.start()  # (raises RuntimeError where no thread can start: nothing is queued then)
                self._thread, self._jobs = thread, jobs
            self._jobs.put((done, fn, args))
        return done

    def stop(self) -> None:
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join(timeout=60)

    def _loop(self, jobs: "queue.Queue") -> None:
        while True:
            try:
                job = jobs.get(timeout=self.IDLE)
            except queue.Empty:
                job = None
            if job is None:  # idle, or stopped: ends unless work came meanwhile
                with self._lock:
                    if jobs.empty():
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
                continue
            done, fn, args = job
            _settle(done, fn, *args)
            job = done = fn = args = None  # (not kept while waiting: they hold the writer, the engine's arrays)


def _settle(done: Future, fn: Callable, *args) -> None:
    """Run ``fn(*args)`` into ``done``: the writer waits on it and decides."""
    if done.set_running_or_notify_cancel():
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)


class Feed:
    """The blocks of one write transaction, from the writer thread (``put``,
    as each is encoded) to the commit thread (iterating, as LMDB copies
    each): the disk writes the first block while later ones are encoded,
    instead of waiting for a whole batch. At most ``ahead`` bytes wait to be
    taken; past that the writer waits, so the bytes held stay bounded."""

    def __init__(self, ahead: Optional[int]):
        self.ahead = ahead  # None: no bound (nothing takes from it until it is closed)
        self.opened = time.monotonic()
        self.on_close: Optional[Callable[[], None]] = None  # run by close(), in its caller
        self.nbytes = 0  # put so far
        self.taken: list[tuple[Node, Entry]] = []
        self._items: "deque[tuple[tuple[Node, Entry], int]]" = deque()
        self._waiting = 0  # bytes put and not yet taken
        self._closed = self._abandoned = False
        self._cond = threading.Condition()

    def put(self, item: tuple[Node, Entry], nbytes: int) -> None:
        with self._cond:
            while self.ahead is not None and self._waiting >= self.ahead and not self._abandoned:
                self._cond.wait()
            if self._abandoned:  # the transaction it was for failed: nothing will take this
                raise StorageError("the write transaction these blocks were for has ended")
            self._items.append((item, nbytes))
            self._waiting += nbytes
            self.nbytes += nbytes
            self._cond.notify_all()

    def close(self) -> None:
        """Nothing more comes: iterating ends once the rest is taken."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self.on_close is not None:
            self.on_close()

    def abandon(self) -> None:
        """The commit thread is done with it (or failed): ``put`` no longer waits."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def __iter__(self) -> Iterator[tuple[Node, Entry]]:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                item, nbytes = self._items.popleft()
                self._waiting -= nbytes
                self._cond.notify_all()
            self.taken.append(item)
            yield item


COMPRESS_ROWS = 2048  # rows of a layer quantized at once, then cut into blocks


def encode(job: Job, node: Node, codec: Codec) -> Block:
    """The block's rows of every layer, compressed. Uncompressed rows stay
    views of the engine's buffers (the job holds those, so mlx never writes
    them in place): ``Stored.pack`` copies them once, straight into the
    block's bytes, and the views go with the ``Block`` right after."""
    s, e = node.start, node.end
    out: list[Optional[Layer]] = []
    for li, l in enumerate(job.layers):
        if isinstance(l, KVLayer):
            # a sliding-window layer may hold only the block's last rows
            first = s if l.start <= s else (l.start if l.window is not None and l.start < e else None)
            if first is None:
                out.append(None)
                continue
            k, v = _compressed_rows(job, li, l, first, e, codec)
            out.append(KVLayer(k, v, first, l.window))
        else:
            out.append(StateLayer([None if a is None else mx.contiguous(a) for a in l.arrays])
                       if e == len(job.tokens) else None)
    block = Block(job.tokens[s:e].copy(), out)
    mx.eval(block_arrays(block))
    return block


def _compressed_rows(job: Job, li: int, l: KVLayer, first: int, e: int, codec: Codec) -> tuple[Tensor, Tensor]:
    """Rows ``[first, e)`` of layer ``li``, compressed. Quantizing (and
    rotating) works row by row, so on the host up to ``COMPRESS_ROWS`` rows are
    done in one go and later blocks are cut from them (q8 at 2K tokens of an
    8B model: 0.56-0.59 s from put to disk instead of 0.66-1.1 s on the 2-core
    box). Not on CUDA: there a block is laid out on the device from contiguous
    arrays, so each slice of a shared chunk would take a copy kernel of its
    own, as many as quantizing block by block (q4 at 8K tokens wrote at 0.49
    GB/s that way, 0.70-0.90 block by block)."""
    def compressed(a: int, b: int) -> tuple[Tensor, Tensor]:
        return (codec.compress_keys(take_rows(l.keys, a - l.start, b - l.start)),
                codec.compress_values(take_rows(l.values, a - l.start, b - l.start)))

    if (codec.key_bits is None and codec.value_bits is None) or cuda.runtime() is not None:
        return compressed(first, e)
    got = job.compressed.get(li)
    if got is None or not (got[0] <= first and e <= got[1]):
        stop = max(e, min(first + COMPRESS_ROWS, l.start + tensor_rows(l.keys)))
        got = job.compressed[li] = (first, stop, *compressed(first, stop))
    start, _, k, v = got
    return take_rows(k, first - start, e - start), take_rows(v, first - start, e - start)
