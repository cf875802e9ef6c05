"""The LMDB tier's read contract: ``stored`` gives a block's checked bytes,
``None`` where there is none, and raises ``BlockDecodeError`` for bytes that
are not a good block of the key asked for."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codec import Block, serialize
from kvstore.errors import BlockDecodeError
from kvstore.hashing import KeyChain, as_tokens, root_key
from kvstore.record import BlockRecord
from kvstore.tiers.base import Entry
from kvstore.tiers.lmdb import LmdbTier

from ._helpers import kv_layers

BS = 256


def _entries(n: int) -> list[Entry]:
    tokens = as_tokens(np.arange(n * BS) % 1000)
    chain = KeyChain(root_key("lmdb-tier-test"), tokens, BS)
    layers = kv_layers(tokens)
    out = []
    for i in range(n):
        s = slice(i * BS, (i + 1) * BS)
        rec = BlockRecord(key=chain.key(i), parent=chain.parent(i), root=chain.root, start=i * BS, length=BS,
                          tokens=tokens[s], nbytes=0)
        block = Block(rec.tokens, [type(l)(l.keys[:, :, s], l.values[:, :, s], i * BS) for l in layers])
        e = Entry(rec, None)
        e.payload = serialize(block, rec.key)
        out.append(e)
    return out


@pytest.fixture
def tier(tmp_path):
    t = LmdbTier.open(tmp_path / "store", budget_bytes=1 << 30)
    yield t
    t.close()


@pytest.mark.parametrize("unread", [False, True])
def test_stored_gives_a_checked_block_or_none(tier, unread):
    a, b = _entries(2)
    tier.store([a])
    with tier.reader() as txn:
        got = tier.stored(txn, a.key, a.record.start, unread=unread)
        assert got is not None and got.key == a.key and got.start == a.record.start and got.intact()
        assert bytes(got.buf) == bytes(a.payload)
        assert tier.stored(txn, b.key, b.record.start, unread=unread) is None  # never stored


@pytest.mark.parametrize("unread", [False, True])
def test_stored_raises_for_a_bad_block(tier, unread):
    a, b, c = _entries(3)
    wrong = Entry(b.record, None)
    wrong.payload = a.payload  # another block's bytes, with this block's record (and so its offset)
    tier.store([wrong])
    # no record: read where LMDB keeps the value
    tier.write(lambda txn: txn.put(c.key, bytes(a.payload)[:64] + b"\0" * 16, db=tier.dbs[b"blocks"]))
    with tier.reader() as txn:
        with pytest.raises(BlockDecodeError):
            tier.stored(txn, b.key, b.record.start, unread=unread)  # bound to another key
        with pytest.raises(BlockDecodeError):
            tier.stored(txn, c.key, c.record.start, unread=unread)  # truncated
