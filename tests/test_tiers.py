"""The ``Tier`` protocol, as every tier keeps it: device, RAM, disk and
remote each take blocks as the writer makes them (``Entry``: record and
bytes), hand them back by key bound to that key, know whether they hold one,
and let them go."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import PrefixStore
from kvstore.blocks.record import Entry
from kvstore.tiers.base import Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk.lmdb import LmdbTier
from kvstore.tiers.ram import RamTier
from kvstore.tiers.remote.tier import RemoteTier

from ._helpers import BS, put, toks
from ._redis import RedisServer, need_redis


@pytest.fixture(scope="module")
def entries(tmp_path_factory) -> list[Entry]:
    """Three blocks of a prompt as the writer stored them."""
    path = tmp_path_factory.mktemp("source")
    with PrefixStore(ssd_path=path, budget_gb=0.1, block_size=BS) as s:
        put(s, toks(3 * BS))
    tier = LmdbTier.open(path, readonly=True)
    try:
        with tier.reader() as txn:
            out = [Entry(r, memoryview(bytes(tier.payload(txn, r.key)))) for r in tier.records(txn)]
    finally:
        tier.close()
    assert len(out) == 3
    return sorted(out, key=lambda e: e.record.start)


def _tiers(tmp_path, request):
    yield DeviceTier(1 << 30)
    yield RamTier(1 << 30)
    disk = LmdbTier.open(tmp_path / "disk")
    request.addfinalizer(disk.close)
    yield disk
    try:
        need_redis()
    except pytest.skip.Exception:  # the other tiers are still checked
        return
    server = RedisServer(tmp_path / "redis").start()
    request.addfinalizer(server.kill)
    remote = RemoteTier(server.url, namespace="tiers")
    remote.connect()
    request.addfinalizer(remote.close)
    yield remote


def test_every_tier_keeps_the_one_protocol(tmp_path, request, entries):
    names = []
    for tier in _tiers(tmp_path, request):
        names.append(tier.name)
        assert isinstance(tier, Tier), tier.name
        assert not tier.contains(entries[0].key) and tier.get(entries[0].key) is None
        assert tier.put(entries) == len(entries), tier.name
        for e in entries:
            assert tier.contains(e.key), tier.name
            got = tier.get(e.key)
            held = got.to_stored() if tier.name == "device" else got
            assert held.key == e.key and bytes(held.buf) == bytes(e.payload), tier.name
            assert np.array_equal(held.tokens, e.record.tokens), tier.name
        gone = entries[-1].key
        assert tier.remove([gone, b"\0" * 16]) == [gone], tier.name
        assert not tier.contains(gone) and tier.get(gone) is None, tier.name
        assert tier.contains(entries[0].key), tier.name
    assert names[:3] == ["device", "ram", "disk"] and names[3:] in ([], ["remote"])
