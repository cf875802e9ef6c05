"""Persistence: what a store on disk keeps across a reopen. Entries keep the
settings they were written with (a store reopened with other ``kv_bits``
reads them as stored); a block found corrupt on disk is a miss from there
on, removed and storable again; the disk budget is kept by evicting least
recently used leaves first, child before parent.

Reopening in another process is tests/test_restart.py; what a reopen
serves, as a state machine, tests/test_store_state.py."""

from __future__ import annotations

import lmdb
import msgpack
import pytest

from kvstore.blocks.codec import Codec
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key

from ._helpers import BS, M, assert_hit_is, kv_layers, put, same, toks

# ------------------------------------------------------------------ reopen


def test_reopening_with_other_kv_bits_reads_old_entries(ssd):
    """Entries remember their own settings: a store reopened with other
    ``kv_bits`` serves old entries as stored and new ones in its settings."""
    a = toks(16)
    s = ssd(kv_bits=None)
    put(s, a)
    s.close()
    s = ssd(kv_bits=4, kv_group_size=32)
    assert_hit_is(s.fetch(M, a), a, 16)  # old dense entries: exact
    b = a + toks(8, 7000)
    assert put(s, b) == 1
    hit = s.fetch(M, b)
    assert hit.length == 24
    for layer, ref in zip(hit.layers, kv_layers(b)):
        assert same(layer.keys[..., :16, :], ref.keys[..., :16, :])
        new_keys = Codec.from_bits(4, 32).compress_keys(ref.keys[..., 16:, :])  # rotated at 4 bits by default
        assert same(layer.keys[..., 16:, :], new_keys.dequantize())
        new_values = Codec.from_bits(4, 32).compress_values(ref.values[..., 16:, :])  # rotated too
        assert same(layer.values[..., 16:, :], new_values.dequantize())
    s.close()
    s = ssd(kv_bits=None)
    hit = s.fetch(M, b)  # and a dense store reads the 4-bit entries back
    assert hit.length == 24
    for layer, ref in zip(hit.layers, kv_layers(b)):
        assert same(layer.values[..., 16:, :], Codec.from_bits(4, 32).compress_values(ref.values[..., 16:, :]).dequantize())


@pytest.mark.parametrize("asked", [None, 32, 4, 5])
def test_a_store_keeps_the_block_size_it_was_made_with(ssd, caplog, asked):
    """A block's key hashes its tokens, so a store is served in the block size
    its blocks were written in: reopened with another (or none), it keeps its
    own, serves the whole stored prefix, and says so when another was asked
    for (issue 41: written with 64, reopened with 256: ``hit 64 of 600``)."""
    a = toks(75)
    s = ssd(block_size=8)
    put(s, a)
    s.close()
    caplog.clear()
    s = ssd(block_size=asked)
    assert s.block_size == 8 and s.config.block_size == 8
    assert_hit_is(s.fetch(M, a), a, 75)
    b = a + toks(30, 9000)
    assert put(s, b) == 5  # in the store's size: 72..80 (the stored tail's block, whole now), 80..88, .., 104..105
    assert_hit_is(s.fetch(M, b), b, 105)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "block_size" in r.getMessage()]
    if asked is None:
        assert warned == []
    else:
        assert len(warned) == 1 and "holds blocks of 8 tokens" in warned[0] and f"block_size={asked}" in warned[0]
    s.close()
    assert ssd(block_size=8, readonly=True).block_size == 8


def test_a_store_made_before_the_block_size_was_recorded_takes_it_from_its_blocks(ssd, tmp_path):
    """Stores written by an earlier kvstore have no layout record: the index's
    second blocks start one block in, so the size is known from them (and
    recorded at the first writable open)."""
    a = toks(40)
    s = ssd(block_size=16)
    put(s, a)
    s.close()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        assert txn.delete(b"layout", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    s = ssd(block_size=None)
    assert s.block_size == 16
    assert_hit_is(s.fetch(M, a), a, 40)
    s.close()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=8, subdir=True, readonly=True)
    with env.begin() as txn:
        assert msgpack.unpackb(txn.get(b"layout", db=env.open_db(b"meta", txn=txn, create=False))) == \
            {"block_size": 16}
    env.close()


# ---------------------------------------------------------- corrupt blocks


def _corrupt(path, key: bytes, how) -> None:
    env = lmdb.open(str(path), max_dbs=8, subdir=True)
    db = env.open_db(b"blocks", create=False)
    with env.begin(write=True) as txn:
        buf = bytearray(txn.get(key, db=db))
        txn.put(key, how(buf), db=db)
    env.close()


@pytest.mark.parametrize("how", [
    pytest.param(lambda b: bytes(b[:-1] + bytes([b[-1] ^ 0xFF])), id="flipped"),
    pytest.param(lambda b: bytes(b[: len(b) // 2]), id="truncated"),
    pytest.param(lambda b: b"garbage", id="garbage"),
])
def test_corrupt_block_on_disk_shortens_the_hit(ssd, tmp_path, how):
    """A bad block is a miss from there on: fetch serves the good prefix
    before it, never raises, counts it, and removes it."""
    p = toks(32)
    s = ssd()
    put(s, p)
    s.close()
    _corrupt(tmp_path / "store", KeyChain(root_key(M), as_tokens(p), BS).key(2), how)
    s = ssd()
    assert_hit_is(s.fetch(M, p), p, 16)
    assert s.stats()["corrupt_blocks"] == 1
    assert_hit_is(s.fetch(M, p), p, 16)
    assert put(s, p) == 2  # the bad block (and what hung below it) can be stored again
    s.flush()
    assert_hit_is(s.fetch(M, p), p, 32)


# ---------------------------------------------------------- disk eviction


def test_trim_disk_evicts_least_recently_used_leaves_first(ssd):
    """Disk eviction takes a leaf before the prefix it hangs from, and the
    least recently used leaf first; blocks still in RAM stay servable."""
    s = ssd()
    shared = toks(16)
    a, b = shared + toks(8, start=5000), shared + toks(8, start=6000)
    put(s, a)
    put(s, b)
    s.flush()
    assert s.stats()["ssd_blocks"] == 4  # 2 shared + one leaf each
    assert_hit_is(s.fetch(M, a), a, 24)  # b's leaf is now the least recently used
    assert s.trim_disk(s.stats()["ssd_bytes"] - 1) == 1
    s.trim_ram(0)
    assert s.fetch(M, b).length == 16 and s.fetch(M, a).length == 24
    assert s.trim_disk(0) == 3  # then a's leaf, then the shared prefix, child before parent
    assert s.stats()["ssd_blocks"] == 0
    s.close()
    assert ssd().fetch(M, a).length == 0
