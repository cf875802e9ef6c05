"""The background writer: ``put`` hashes, indexes and queues; the writer
thread encodes the blocks (quantizing many rows at once) into reused
buffers, and a commit thread writes them to disk in transactions that
stream blocks in while the next ones are encoded.

- Queued work is bounded: past the bound a put is skipped whole, never run
  in the caller. The bound counts what a queued put keeps alive until it is
  encoded: an engine's buffers whole.
- A put never waits on a disk transaction.
- A put of many batches lands whole; a failed write leaves the writer free
  and RAM serving; where no thread can start (an exiting interpreter) the
  blocks are still written, by the writer or in the caller's thread.
- An interrupt part-way through a put run in the caller (no thread could
  start) leaves no transaction open.

What ``put`` is given is what is stored, whatever the caller does after:
tests/test_put_values.py."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import mlx.core as mx
import numpy as np
import pytest

from kvstore.blocks.hashing import root_key
from kvstore.blocks.layers import KVLayer
from kvstore.store import PrefixStore

from ._helpers import (BLOCK_BYTES, BS, M, assert_hit_is, bits_of, block_by_block, blocks_on_disk, kv_layers, lmdb_of,
                       put, state_at, toks)

# ------------------------------------------------------------ the queue bound


def test_a_put_past_the_bound_is_skipped_whole_and_the_caller_never_waits(ssd, monkeypatch):
    """Queued work is bounded: a put that would pass the bound is skipped
    whole (counted as ``puts_skipped`` and ``blocks_skipped``), never done in
    the caller's thread; the put before it is stored, no block of the skipped
    one is indexed, and the same prompt put again once the writer has caught
    up is stored."""
    block_by_block(monkeypatch)
    s = ssd(max_pending_bytes=1)
    with s.pause_writer():  # the writer thread is held: puts stay queued
        a, b = toks(20), toks(20, start=5000)
        put(s, a)
        assert put(s, b) == 0  # pending work is over the bound: skipped (the writer still waits)
        st = s.stats()
        assert (st["puts_skipped"], st["blocks_skipped"]) == (1, 20 // BS + (20 % BS > 0))
        assert s.contains(M, b) == 0 and s.fetch(M, b).length == 0
    s.flush()
    assert_hit_is(s.fetch(M, a), a, 20)
    assert put(s, b) > 0
    s.flush()
    assert_hit_is(s.fetch(M, b), b, 20)
    assert s.stats()["puts_skipped"] == 1


def test_a_fetch_of_a_put_not_yet_stored_is_served_from_the_puts_own_arrays(ssd, monkeypatch):
    """A prompt fetched while the writer has not yet stored its put (the
    next turn of a conversation) is served at once, bit-exact, from the rows
    the put still holds (``tokens_queued``), without waiting for the writer;
    once stored it is served from the store, the same."""
    s = ssd()
    with s.pause_writer():  # the writer thread is held: puts stay queued
        a = toks(20)
        put(s, a)
        longer = list(a) + list(toks(6, start=900))
        assert_hit_is(s.fetch(M, longer), a, 20)  # (the writer is still held: no block of it is stored)
        st = s.stats()
        assert (st["tokens_queued"], st["fetch_waited_us"], st["blocks_stored"]) == (20, 0, 0)
    s.flush()
    assert_hit_is(s.fetch(M, longer), a, 20)
    assert s.stats()["tokens_queued"] == 20


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_stores_fetch_of_a_queued_put_gives_what_its_stored_blocks_give(ssd, monkeypatch, bits):
    """A quantizing store serves a queued put's rows through its codec (4-bit
    keys rotated too): the same bits as a read of the blocks once stored, so
    no hit depends on how far the writer has got."""
    s = ssd(kv_bits=bits, kv_group_size=32)
    with s.pause_writer():  # the writer thread is held: puts stay queued
        a = toks(3 * BS + 5)
        put(s, a, heads=2, dim=64)
        longer = list(a) + list(toks(6, start=900))
        early = s.fetch(M, longer)
        st = s.stats()
        assert (early.length, st["tokens_queued"], st["fetch_waited_us"], st["blocks_stored"]) == (len(a), len(a), 0, 0)
    s.flush()
    stored = s.fetch(M, longer)
    assert stored.length == len(a) and s.stats()["tokens_queued"] == len(a)
    assert all(np.array_equal(bits_of(x), bits_of(y)) for e, t in zip(early.layers, stored.layers)
               for x, y in ((e.keys, t.keys), (e.values, t.values)))


def test_a_fetch_of_stored_blocks_then_a_queued_puts_reads_the_stored_ones_as_stored(ssd, monkeypatch):
    """Where a prompt's first blocks are stored already (here dense, by an
    earlier open) and the rest is still queued, the stored blocks are read as
    they are and only the queued put's own rows go through the codec: the
    same hit as once everything is stored."""
    a = toks(2 * BS)
    s = ssd()
    put(s, a)
    s.close()
    s = ssd(kv_bits=4, kv_group_size=32)
    with s.pause_writer():  # the writer thread is held: puts stay queued
        b = list(a) + list(toks(BS + 3, start=900))
        put(s, b)
        early = s.fetch(M, b + [1])
        st = s.stats()
        assert (early.length, st["tokens_queued"], st["fetch_waited_us"]) == (len(b), BS + 3, 0)
        for layer, ref in zip(early.layers, kv_layers(a)):  # the stored dense rows, exact
            assert np.array_equal(bits_of(layer.keys[..., : 2 * BS, :]), bits_of(ref.keys))
    s.flush()
    stored = s.fetch(M, b + [1])
    assert stored.length == len(b)
    assert all(np.array_equal(bits_of(x), bits_of(y)) for e, t in zip(early.layers, stored.layers)
               for x, y in ((e.keys, t.keys), (e.values, t.values)))


def test_the_cost_plan_weighs_a_queued_puts_rows_with_the_stored_prefix_before_them(ssd, monkeypatch):
    """Under ``fetch_policy="auto"``, a stored block that alone would lose to
    recomputing it (here: a slow disk against 1 ms a token) is still served
    where a queued put's rows follow it: those are in hand already, and the
    two together beat recomputing the prompt. (Planned alone, the stored
    block was declined and the put's rows went with it: a miss.)"""
    a = toks(BS)
    s = ssd()
    put(s, a)
    s.close()
    slow = BLOCK_BYTES / (3 * BS * 1e-3) / 1e9  # GB/s at which the stored block loads in 3 tokens' prefill time
    s = ssd(prior_ram_gbps=10.0, prior_ssd_cached_gbps=slow, prior_ssd_cold_gbps=slow, remember_rates=False)
    with s.pause_writer():  # the writer thread is held: puts stay queued
        for n in (BS, 4 * BS, 16 * BS, 64 * BS):
            s.observe_prefill(M, 0, n, n * 1e-3)
        assert s.fetch(M, list(a) + [1]).length == 0  # the stored block alone: declined
        b = list(a) + list(toks(10 * BS, start=900))
        put(s, b)
        hit = s.fetch(M, b + [1])
        st = s.stats()
        assert (hit.length, st["tokens_queued"], st["fetch_waited_us"]) == (len(b), 10 * BS, 0)
        assert_hit_is(hit, b, len(b))


def test_a_fetch_that_cannot_use_a_queued_put_waits_for_it_and_counts_the_wait(ssd, monkeypatch):
    """Where the put's rows cannot be handed over as they are (here: under
    ``ssd_admit="reuse"``, which must see the blocks stored to count the
    reuse), the fetch waits for the writer to store them, and the time it
    waited is counted (``fetch_waited_us``)."""
    s = ssd(ssd_admit="reuse")
    with ExitStack() as held:
        held.enter_context(s.pause_writer())  # the writer thread is held: the put stays queued
        a = toks(20)
        put(s, a)
        opener = threading.Timer(1.0, held.close)  # the writer goes on while the fetch waits
        opener.start()
        assert_hit_is(s.fetch(M, a), a, 20)
        opener.join()
    st = s.stats()
    assert st["fetch_waited_us"] > 0 and st["tokens_queued"] == 0  # (it waited; how long is the box's business)


def test_a_job_lets_go_of_the_engines_arrays_once_encoded_not_once_written(ssd, monkeypatch):
    """The bound counts arrays the queue keeps alive: a job's share leaves
    ``pending_bytes`` as soon as its blocks are encoded, while the disk
    transaction is still being written, so the next put queues instead of
    being skipped behind a slow disk."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    written = threading.Event()
    real = LmdbTier.store

    def store(self, *a, **kw):  # the disk write waits (10 s at most)
        written.wait(10)
        return real(self, *a, **kw)

    monkeypatch.setattr(LmdbTier, "store", store)
    s = ssd(max_pending_bytes=1)  # a second put queued while the first is pending is skipped
    a = toks(20)
    put(s, a)
    for _ in range(500):  # until the writer has encoded the put and waits on the disk
        if s.stats()["pending_bytes"] == 0:
            break
        threading.Event().wait(0.01)
    assert s.stats()["pending_bytes"] == 0 and s.stats()["ssd_blocks"] == 0  # encoded, not yet written
    assert put(s, toks(20, start=5000)) > 0  # queued, not skipped
    written.set()
    s.flush()
    assert s.stats()["puts_skipped"] == 0 and s.stats()["ssd_blocks"] > 0


def test_the_queue_bound_counts_the_whole_buffers_a_put_keeps(ssd, monkeypatch):
    """A put given an engine's buffers with ``rows=n`` keeps them whole until
    its blocks are written, spare rows included: the queued bytes count all of
    them, not only the rows stored."""
    s = ssd()
    with s.pause_writer():  # the writer thread is held: puts stay queued
        p = toks(20)
        spare = 4 * len(p)  # rows of each buffer: a KVCache's step leaves most of them unused
        layers = [KVLayer(mx.random.normal((1, 1, spare, 32)).astype(mx.float16),
                          mx.random.normal((1, 1, spare, 32)).astype(mx.float16), rows=len(p)) for _ in range(2)]
        assert s.put(M, p, layers) > 0
        held = sum(l.keys.nbytes + l.values.nbytes for l in layers)
        assert s.stats()["pending_bytes"] == held == 4 * sum(l.nbytes for l in layers)
    s.flush()
    assert s.stats()["pending_bytes"] == 0
    hit = s.fetch(M, p)
    assert hit.length == 20
    for got, given in zip(hit.layers, layers):
        assert mx.array_equal(got.keys, given.keys[:, :, :20]) and mx.array_equal(got.values, given.values[:, :, :20])


# ------------------------------------------------------- the engine comes first


def test_the_writer_waits_between_blocks_while_an_engine_call_runs(ssd):
    """While an engine's fetch or put runs, the writer encodes nothing more
    (it would take the interpreter from the engine's thread at every call
    that leaves it); it goes on once the call ends."""
    s = ssd(writer_patience_s=30)
    p = toks(4 * BS)
    with s.engine_call():  # an engine call under way (as fetch and put hold it)
        assert put(s, p) == 4
        threading.Event().wait(0.5)
        assert s.stats()["blocks_stored"] == 0
    s.flush(timeout=30)
    assert s.stats()["blocks_stored"] == 4
    assert_hit_is(s.fetch(M, p), p, 4 * BS)


def test_engine_calls_without_a_gap_slow_the_writer_but_never_stop_it(ssd):
    """The writer's wait at each block is bounded (``writer_patience_s``): an
    engine that is always inside the store still sees its puts stored."""
    s = ssd(writer_patience_s=0.01)
    p = toks(4 * BS)
    with s.engine_call():
        assert put(s, p) == 4
        s.flush(timeout=30)
        assert s.stats()["blocks_stored"] == 4


# ---------------------------------------------------- encoding and transactions


def test_a_put_of_many_batches_is_written_whole_while_encoding_overlaps(ssd, monkeypatch):
    """Batches go to the commit thread one at a time while the writer encodes
    the next: after a flush every block is on disk, and a reopened store
    serves the whole prompt exactly."""
    p = toks(10 * BS)
    s = ssd(write_batch_bytes=1)  # every block its own batch and transaction
    assert put(s, p) == 10
    s.flush()
    assert s.stats()["ssd_blocks"] == 10
    s.close()
    hit = ssd(budget_gb=0).fetch(M, p)
    assert hit.length == 10 * BS and hit.ssd_tokens == 10 * BS
    assert_hit_is(hit, p, 10 * BS)


def test_a_transaction_copies_the_first_block_before_the_writer_has_encoded_the_last(ssd, monkeypatch):
    """Blocks stream into the write transaction as they are encoded: LMDB
    has the first block of a put before the writer encodes its last one, so
    the disk is not idle while a whole batch is encoded first; the put
    still lands whole, in one transaction."""
    import kvstore.convert.encode as encoding
    from kvstore.tiers.disk.lmdb import LmdbTier

    events: list[str] = []
    real_encode, real_store = encoding.encode, LmdbTier.store

    def encode(job, node, *a):
        if node.start // BS == 4:  # the last block waits (5 s at most) for the transaction to take the first
            deadline = __import__("time").monotonic() + 5
            while "copy 0" not in events and __import__("time").monotonic() < deadline:
                threading.Event().wait(0.01)
        events.append(f"encode {node.start // BS}")  # (after the wait: a transaction that waits for all fails)
        return real_encode(job, node, *a)

    def store(self, entries, *args):
        def seen():
            for e in entries:
                events.append(f"copy {e.record.start // BS}")
                yield e
        events.append("transaction")
        return real_store(self, seen(), *args)

    monkeypatch.setattr(encoding, "encode", encode)
    block_by_block(monkeypatch)
    monkeypatch.setattr(LmdbTier, "store", store)
    s = ssd(budget_gb=0, write_seconds=60)  # (a transaction open over write_seconds is closed and another begun)
    p = toks(5 * BS)
    assert put(s, p) == 5
    s.flush()
    assert events.index("copy 0") < events.index("encode 4")
    assert events.count("transaction") == 1 and sorted(e for e in events if e.startswith("copy")) == \
        [f"copy {i}" for i in range(5)]
    s.close()
    hit = ssd(budget_gb=0).fetch(M, p)
    assert hit.ssd_tokens == 5 * BS
    assert_hit_is(hit, p, 5 * BS)


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_quantized_together_are_the_rows_quantized_block_by_block(tmp_path, monkeypatch, bits):
    """The writer quantizes (and rotates) many rows of a layer at once and
    cuts the blocks from them; each block's stored bytes are exactly those of
    quantizing the block alone."""
    p = toks(5 * BS)
    layers = kv_layers(p, heads=2, dim=64)
    stored = {}
    for rows in (BS, 3 * BS):  # block by block; three blocks at once (a chunk ending mid-prompt)
        path = tmp_path / f"s{rows}"
        with PrefixStore(budget_gb=0, block_size=BS, ssd_path=path, kv_bits=bits, rotate_keys=True,
                         compress_rows=rows) as s:
            assert s.put(M, p, layers) == 5
        stored[rows] = blocks_on_disk(path)
    assert len(stored[BS]) == 5 and stored[BS] == stored[3 * BS]


def test_a_disk_only_store_serializes_into_the_buffers_it_wrote_before(ssd):
    """Blocks written through (no RAM to keep them) hand their bytes back,
    and the next put's blocks are serialized into them: no fresh memory (page
    faults) per block in the steady state, and every block still exact."""
    from kvstore.gpu import buffers

    big = dict(n_layers=2, heads=16, dim=1024)  # 1 MiB blocks: the size buffers are kept for
    s = ssd(budget_gb=0)
    a, b = toks(4 * BS), toks(4 * BS, start=5000)
    s.put(M, a, kv_layers(a, **big))
    s.flush()
    handed_back = {r.ctypes.data for r in buffers._waiting}
    assert handed_back
    taken: list[int] = []
    real = buffers.take

    def take(n):
        out = real(n)
        taken.append(out.ctypes.data)
        return out

    try:
        buffers.take = take
        s.put(M, b, kv_layers(b, **big))
        s.flush()
    finally:
        buffers.take = real
    assert handed_back & set(taken)
    for p in (a, b):
        hit = s.fetch(M, p)
        assert hit.ssd_tokens == len(p)
        assert_hit_is(hit, p, len(p), **big)


# ------------------------------------------------------ the commit thread


def test_put_leaves_every_disk_write_to_the_background_threads(ssd, monkeypatch):
    """A put never waits on a disk transaction (an fsync): not for its blocks
    and not for the first description of a new model, which still lands."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    writers: list[str] = []
    real = LmdbTier.write

    def write(self, *a, **kw):
        writers.append(threading.current_thread().name)
        return real(self, *a, **kw)

    monkeypatch.setattr(LmdbTier, "write", write)
    s = ssd()
    writers.clear()  # (opening the store writes its settings)
    put(s, toks(3 * BS))
    put(s, toks(3 * BS))  # nothing new
    s.flush()
    assert writers and threading.current_thread().name not in writers
    s.close()
    with lmdb_of(s.config.ssd_path) as disk:
        assert root_key(M, s.namespace) in disk.models()


def test_a_write_that_fails_part_way_leaves_the_writer_free_and_ram_serving(ssd, monkeypatch):
    """When the disk write fails after taking some blocks, the writer is not
    left waiting on the transaction: the put finishes, the failure is
    counted, RAM still serves the prompt, and the next put is written."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    real_store = LmdbTier.store
    calls = []

    def store(self, entries, *args):
        calls.append(1)
        if len(calls) == 1:
            next(iter(entries))
            raise OSError(5, "Input/output error")
        return real_store(self, entries, *args)

    monkeypatch.setattr(LmdbTier, "store", store)
    s = ssd()
    p = toks(6 * BS)
    assert put(s, p) == 6
    s.flush(timeout=30)
    assert s.stats()["pending_jobs"] == 0
    st = s.stats()
    assert st["write_errors"] == 1 and st["ssd_blocks"] == 0
    assert_hit_is(s.fetch(M, p), p, 6 * BS)
    q = toks(3 * BS, start=5000)
    assert put(s, q) == 3
    s.flush(timeout=30)
    assert s.stats()["ssd_blocks"] == 3


# ---------------------------------------------- no thread, interrupted puts


def test_where_no_commit_thread_can_start_the_writer_writes_the_blocks_itself(ssd, monkeypatch):
    """An exiting interpreter (Python 3.12+) refuses new threads: a put whose
    commit thread cannot start is still written whole, by the writer."""
    real_start = threading.Thread.start

    def start(self):
        if self.name == "kvstore-commit":
            raise RuntimeError("can't create new thread at interpreter shutdown")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    s = ssd(budget_gb=0, write_batch_bytes=1)  # several transactions
    p = toks(6 * BS)
    assert put(s, p) == 6
    s.flush(timeout=30)
    assert s.stats()["pending_jobs"] == 0 and s.stats()["ssd_blocks"] == 6
    assert_hit_is(s.fetch(M, p), p, 6 * BS)


def test_where_no_thread_can_start_a_put_is_written_in_the_callers_thread(ssd, monkeypatch):
    """An exiting interpreter (Python 3.12+) refuses new threads: a put (and a
    new model's description) then runs in the caller, written whole, with no
    error raised into the engine and nothing left pending."""
    from kvstore.blocks.hashing import root_key

    def start(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", start)
    s = ssd(budget_gb=0)  # (opening starts the writer thread where it can)
    p = toks(4 * BS)
    assert put(s, p) == 4
    assert s.stats()["ssd_blocks"] == 4 and s.stats()["pending_bytes"] == 0
    monkeypatch.undo()
    assert_hit_is(s.fetch(M, p), p, 4 * BS)
    s.close()
    with lmdb_of(s.config.ssd_path) as disk:  # the new model's description, written in the caller too
        assert root_key(M, s.namespace) in disk.models()


def test_an_interrupt_while_the_engine_thread_encodes_leaves_no_transaction_open(ssd, monkeypatch):
    """A put run in the engine's thread (where no thread can start, an
    exiting interpreter) that is interrupted (Ctrl-C) part-way: the interrupt reaches the engine
    once the blocks handed over are written, the others are stored by the
    next put, and the store closes (no write transaction left waiting for
    blocks that never come)."""
    import kvstore.convert.encode as encoding

    real_encode = encoding.encode

    def encode(job, node, *a):
        if node.start >= 3 * BS and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        return real_encode(job, node, *a)

    real_start = threading.Thread.start

    def start(self):  # no writer thread can start: puts run in the caller (the commit thread still starts)
        if self.name == "kvstore-writer":
            raise RuntimeError("can't create new thread at interpreter shutdown")
        return real_start(self)

    monkeypatch.setattr(encoding, "encode", encode)
    monkeypatch.setattr(threading.Thread, "start", start)
    block_by_block(monkeypatch)
    s = ssd(budget_gb=0)
    p = toks(6 * BS)
    with pytest.raises(KeyboardInterrupt):
        put(s, p)
    monkeypatch.undo()
    assert s.stats()["ssd_blocks"] == 3  # (written by the time the interrupt reaches the engine)
    assert put(s, p) == 3  # the blocks never encoded are not taken as stored
    s.flush(timeout=30)
    assert s.stats()["ssd_blocks"] == 6
    assert_hit_is(s.fetch(M, p), p, 6 * BS)
    done = threading.Event()
    threading.Thread(target=lambda: (s.close(), done.set()), daemon=True).start()
    assert done.wait(30)


def test_a_burst_of_one_conversations_turns_keeps_them_all_the_later_put_taking_over_the_earlier(ssd, monkeypatch):
    """Issue 54: a fast engine's puts come faster than the writer stores them. A later turn of a conversation
    (a longer prompt starting with a queued one) takes the queued put's blocks over, with its own arrays,
    instead of being skipped: every turn is stored (``puts_superseded``), nothing skipped, and each is a
    bit-exact hit. A put of another prompt past the bound is still skipped whole, and counted."""
    block_by_block(monkeypatch)
    s = ssd(max_pending_bytes=1)
    turns = [toks(12 + 10 * i) for i in range(4)]  # each turn's prompt extends the one before
    other = toks(20, start=7000)
    with s.pause_writer():  # the writer is held: every put stays queued
        for t in turns:
            assert put(s, t) > 0
        assert put(s, other) == 0  # another prompt: past the bound, skipped
    s.flush()
    st = s.stats()
    assert (st["puts_superseded"], st["puts_skipped"]) == (3, 1)
    for t in turns:
        assert_hit_is(s.fetch(M, t), t, len(t))
    assert s.fetch(M, other).not_served == {"skipped": 16, "tail": 4}
    s.close()
    s = ssd()  # written through to disk, as any put
    for t in turns:
        assert_hit_is(s.fetch(M, t), t, len(t))


def test_a_later_turn_of_a_model_with_state_does_not_take_an_earlier_put_over(ssd, monkeypatch):
    """A state snapshot is valid at its own length only: a longer put cannot stand in for a shorter one's
    snapshot, so past the bound it is skipped, as before."""
    block_by_block(monkeypatch)
    s = ssd(max_pending_bytes=1)
    a, b = toks(16), toks(24)
    with s.pause_writer():
        assert s.put(M, a, [kv_layers(a, n_layers=1)[0], state_at(a)]) > 0
        assert s.put(M, b, [kv_layers(b, n_layers=1)[0], state_at(b)]) == 0
    s.flush()
    assert (s.stats()["puts_superseded"], s.stats()["puts_skipped"]) == (0, 1)
    assert s.fetch(M, a).length == 16
