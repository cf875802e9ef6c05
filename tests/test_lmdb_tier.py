"""The LMDB tier (kvstore/tiers/disk/lmdb.py): blocks' values and their records.

- A transaction that outgrows the map is retried whole with a larger map.
- Writes start each value's write-out at its place in data.mdb, and prefill
  page cache only where LMDB appends (never over a value written before).
- Reads copy each block straight out of the map where its record says it
  lies, and fall back to LMDB where the record points at other bytes.
- ``stored`` gives a block's checked bytes, ``None`` where there is none, and
  raises ``BlockDecodeError`` for bytes that are not a good block of the key
  asked for."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.blocks.codec import Block
from kvstore.blocks.wire import serialize
from kvstore.errors import BlockDecodeError
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
from kvstore.blocks.record import BlockRecord, Entry
from kvstore.tiers.disk.lmdb import LmdbTier

from ._helpers import BS, M, assert_hit_is, blocks_on_disk, kv_layers, lmdb_of, put, toks

KEY_BYTES = 16  # a block key: xxh3-128

# ----------------------------------------------------------------- resize


def test_a_transaction_that_outgrows_the_map_is_written_again_whole(ssd, monkeypatch):
    """A streamed transaction that fills the map part-way (no room made
    ahead) is retried with a larger map: the blocks it had taken are written
    again with the rest, and every block is on disk and exact."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    grown: list[int] = []
    real_grow = LmdbTier._grow
    monkeypatch.setattr(LmdbTier, "_make_room", lambda self, nbytes: None)
    monkeypatch.setattr(LmdbTier, "_grow", lambda self, target: (grown.append(target), real_grow(self, target))[1])
    big = dict(heads=8, dim=256)  # 64 KiB per layer per block: 40 blocks outgrow a new store's first map
    s = ssd(budget_gb=0)
    p = toks(40 * BS)
    s.put(M, p, kv_layers(p, **big))
    s.flush()
    assert grown and s.stats()["ssd_blocks"] == 40
    s.close()
    hit = ssd(budget_gb=0).fetch(M, p)
    assert hit.ssd_tokens == 40 * BS
    assert_hit_is(hit, p, 40 * BS, **big)


# -------------------------------------------------- write-out, prefill


@pytest.mark.skipif(not __import__("kvstore.tiers.disk.residency").tiers.disk.residency.can_start_writeback(),
                    reason="sync_file_range is Linux-only")
def test_each_block_starts_its_write_out_where_its_bytes_lie_in_the_file(ssd, monkeypatch):
    """The writer asks the kernel to write each value out as soon as it is in
    the map, at its real place in data.mdb (what lies there is the block)."""
    import os

    import kvstore.tiers.disk.lmdb as lmdb_tier

    asked: list[tuple[int, int]] = []
    real = lmdb_tier.start_writeback
    monkeypatch.setattr(lmdb_tier, "start_writeback", lambda fd, off, n: (asked.append((off, n)), real(fd, off, n)))
    s = ssd(budget_gb=0)
    p = toks(5 * BS)
    assert put(s, p) == 5
    s.flush()
    assert len(asked) == 5
    s.close()
    fd = os.open(s.config.ssd_path / "data.mdb", os.O_RDONLY)
    try:
        on_file = {os.pread(fd, n, off) for off, n in asked}
    finally:
        os.close(fd)
    assert on_file == set(blocks_on_disk(s.config.ssd_path).values())


@pytest.mark.skipif(not __import__("kvstore.tiers.disk.residency").tiers.disk.residency.can_start_writeback(),
                    reason="Linux only")
def test_the_pages_a_write_takes_are_prefilled_only_where_lmdb_appends(ssd, monkeypatch):
    """A store with no free pages gets its values past the last page in use:
    those pages' cache is put in place before the copy (zeros written over
    unused pages), and every value lies inside them. With free pages (after
    an eviction) LMDB may reuse them instead, and nothing is prefilled."""
    import kvstore.tiers.disk.lmdb as lmdb_tier

    big = dict(heads=4, dim=256)  # 64 KiB blocks: values on pages of their own
    s = ssd(budget_gb=0)
    ranges: list[tuple[int, int]] = []  # file offsets
    real = lmdb_tier.prefill

    def prefill(fd, off, n):
        ranges.append((off, n))
        return real(fd, off, n)

    monkeypatch.setattr(lmdb_tier, "prefill", prefill)
    p = toks(6 * BS)
    s.put(M, p, kv_layers(p, **big))
    s.close()
    with lmdb_of(s.config.ssd_path) as disk, disk.reader() as txn:
        spans = [(disk.offset_of(v), len(v)) for _, v in txn.cursor(db=disk.dbs[b"blocks"])]
    s = ssd(budget_gb=0)
    assert len(spans) == 6 and ranges
    assert all(any(a <= off and off + n <= a + m for a, m in ranges) for off, n in spans)
    assert s.trim_disk(s.stats()["ssd_bytes"] // 2) >= 1  # frees pages inside the file
    ranges.clear()
    q = toks(3 * BS, start=9000)
    s.put(M, q, kv_layers(q, **big))
    s.flush()
    assert ranges == []
    assert_hit_is(s.fetch(M, q), q, len(q), **big)


@pytest.mark.skipif(not __import__("kvstore.tiers.disk.residency").tiers.disk.residency.can_start_writeback(),
                    reason="Linux only")
def test_a_value_appended_without_prefill_is_never_zeroed_by_the_next_ones_prefill(tmp_path):
    """Where free pages could hold a value, nothing is prefilled for it, yet
    LMDB may append it after all (pages freed by the last transaction are not
    reusable yet): a larger value after it in the same transaction must not
    have its prefill start below it. Both come back intact."""
    from kvstore.blocks.record import BlockRecord
    from kvstore.blocks.record import Entry
    from kvstore.tiers.disk.lmdb import LmdbTier

    def entry(i: int, n: int, fill: int) -> Entry:
        key = i.to_bytes(KEY_BYTES, "little")
        return Entry(BlockRecord(key=key, parent=b"\1" * KEY_BYTES, root=b"\1" * KEY_BYTES, start=0, length=1,
                                 tokens=np.zeros(1, np.int32), nbytes=n), memoryview(bytes([fill]) * n))

    MiB = 1 << 20
    tier = LmdbTier(tmp_path / "s", budget_bytes=1 << 30)
    try:
        assert tier.writemap
        tier.store([entry(i, 2 * MiB, 7) for i in range(1, 4)], 6 * MiB)
        tier.remove([i.to_bytes(KEY_BYTES, "little") for i in range(1, 4)])  # ~6 MiB of free pages
        small, big = entry(10, MiB, 0xAB), entry(11, 8 * MiB, 0xCD)
        tier.store(iter([small, big]), 9 * MiB)
        with tier.reader() as txn:
            assert bytes(tier.payload(txn, small.key)) == bytes([0xAB]) * MiB
            assert bytes(tier.payload(txn, big.key)) == bytes([0xCD]) * 8 * MiB
    finally:
        tier.close()


# ------------------------------------------------------------ reads, records


def test_a_disk_hit_reads_no_block_whole_before_copying_it(ssd, monkeypatch):
    """Disk blocks are copied straight out of the map where their records
    say they lie: no block is read whole first (py-lmdb's get reads every
    page of a value before it returns, so a cold hit read all its blocks
    before copying the first)."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    big = dict(heads=4, dim=256)  # values on pages of their own
    p = toks(4 * BS)
    s = ssd()
    s.put(M, p, kv_layers(p, **big))
    s.flush()
    s.close()
    s = ssd(budget_gb=0)
    got: list[bytes] = []
    real = LmdbTier.payload
    monkeypatch.setattr(LmdbTier, "payload", lambda self, txn, key: (got.append(key), real(self, txn, key))[1])
    hit = s.fetch(M, p)
    assert hit.ssd_tokens == len(p) and got == []
    assert_hit_is(hit, p, len(p), **big)


def test_a_record_pointing_at_other_bytes_falls_back_to_lmdb(ssd):
    """Where a record's offset holds another block's bytes (a store copied
    elsewhere, a record from another writer), the block is read through
    LMDB: the hit is whole and exact, and nothing is dropped as corrupt."""
    from dataclasses import replace

    from kvstore.blocks.record import BlockRecord

    big = dict(heads=4, dim=256)
    p = toks(3 * BS)
    s = ssd()
    s.put(M, p, kv_layers(p, **big))
    s.close()
    disk = LmdbTier(s.config.ssd_path)  # the closed store's tier, on its own
    try:
        with disk.env.begin(write=True) as txn:
            recs = [BlockRecord.unpack(bytes(k), bytes(v)) for k, v in txn.cursor(db=disk.dbs[b"nodes"])]
            offsets = [r.offset for r in recs]
            assert all(o >= 0 for o in offsets)
            for r, o in zip(recs, offsets[1:] + offsets[:1]):  # each record points at the next block's bytes
                txn.put(r.key, replace(r, offset=o).pack(), db=disk.dbs[b"nodes"])
    finally:
        disk.close()
    s = ssd(budget_gb=0)
    hit = s.fetch(M, p)
    assert hit.ssd_tokens == len(p)
    assert_hit_is(hit, p, len(p), **big)
    assert s.stats()["ssd_blocks"] == 3


# ------------------------------------------------------ the read contract


def _chain_entries(n: int) -> list[Entry]:
    tokens = as_tokens(np.arange(n * BS) % 1000)
    chain = KeyChain(root_key("lmdb-tier-test"), tokens, BS)
    layers = kv_layers(tokens)
    out = []
    for i in range(n):
        s = slice(i * BS, (i + 1) * BS)
        rec = BlockRecord(key=chain.key(i), parent=chain.parent(i), root=chain.root, start=i * BS, length=BS,
                          tokens=tokens[s], nbytes=0)
        block = Block(rec.tokens, [type(l)(l.keys[:, :, s], l.values[:, :, s], i * BS) for l in layers])
        out.append(Entry(rec, serialize(block, rec.key)))
    return out


@pytest.fixture
def tier(tmp_path):
    t = LmdbTier.open(tmp_path / "store", budget_bytes=1 << 30)
    yield t
    t.close()


@pytest.mark.parametrize("unread", [False, True])
def test_stored_gives_a_checked_block_or_none(tier, unread):
    a, b = _chain_entries(2)
    tier.store([a])
    with tier.reader() as txn:
        got = tier.stored(txn, a.key, a.record.start, unread=unread)
        assert got is not None and got.key == a.key and got.start == a.record.start and got.intact()
        assert bytes(got.buf) == bytes(a.payload)
        assert tier.stored(txn, b.key, b.record.start, unread=unread) is None  # never stored


@pytest.mark.parametrize("unread", [False, True])
def test_stored_raises_for_a_bad_block(tier, unread):
    a, b, c = _chain_entries(3)
    wrong = Entry(b.record, a.payload)  # another block's bytes, with this block's record (and so its offset)
    tier.store([a, wrong])
    # no record: read where LMDB keeps the value
    tier.write(lambda txn: txn.put(c.key, bytes(a.payload)[:64] + b"\0" * 16, db=tier.dbs[b"blocks"]))
    with tier.reader() as txn:
        with pytest.raises(BlockDecodeError):
            tier.stored(txn, b.key, b.record.start, unread=unread)  # bound to another key
        with pytest.raises(BlockDecodeError):
            tier.stored(txn, c.key, c.record.start, unread=unread)  # truncated
