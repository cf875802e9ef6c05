"""The device tier (GPU memory for hot blocks, CUDA): a hit that moved blocks
to the GPU keeps a device copy of each under ``device_budget_gb``; the next
hit is cut from those copies with the same KV; copies go least recently used
first, with ``trim_device``, and with their blocks.

Driven on this CPU through ``kvstore.gpu.cuda``'s own code paths on a runtime
whose copy engine is ``memmove`` and whose page-locked memory is the heap
(test_cuda_staging.py): the store, the table and ``gather``'s device path
are the code a GPU runs; only the copies differ. Without CUDA the tier is
off (the RAM tier is the device's memory there)."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest

from kvstore import PrefixStore
from kvstore.gpu import cuda
from kvstore.blocks import wire

from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
from kvstore.blocks.layers import Quantized

from kvstore.config import GB

from ._helpers import BLOCK_BYTES, BS, M, assert_hit_is, bits_of, kv_layers, toks
from .test_cuda_staging import PinnedHostRuntime, _drain_pool


@pytest.fixture
def on_gpu(monkeypatch):
    if cuda.runtime() is None:  # (a real GPU is used as it is)
        rt = PinnedHostRuntime()
        monkeypatch.setattr(cuda, "runtime", lambda: rt)
    yield
    _drain_pool()


def _store(**kw) -> PrefixStore:
    return PrefixStore(**dict(dict(budget_gb=1, block_size=BS, fetch_policy="always"), **kw))


def test_a_hit_keeps_device_copies_and_the_next_hit_is_cut_from_them(on_gpu):
    p = toks(4 * BS)
    with _store(device_budget_gb=0.01) as s:
        s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        assert s.stats()["device_blocks"] == 0
        first = s.fetch(M, p)
        assert_hit_is(first, p, 4 * BS, heads=2, dim=64)
        st = s.stats()
        assert st["device_blocks"] == 4 and st["device_bytes"] > 0 and st["ram_blocks"] == 0  # (distinct tiers)
        rt = cuda.runtime()
        moved = getattr(rt, "copies", None)
        again = s.fetch(M, p)  # from the device copies: nothing crosses the bus
        assert_hit_is(again, p, 4 * BS, heads=2, dim=64)
        assert moved is None or rt.copies == moved
        part = s.fetch(M, p[: 2 * BS + 3] + [7])  # a prefix ending inside a block
        assert_hit_is(part, p, 2 * BS + 3, heads=2, dim=64)


def test_device_copies_stay_under_their_budget_least_recently_used_first(on_gpu):
    """The budget counts the GPU memory held: a hit's arrays count whole
    while any of their blocks is kept (none of it is freed before the last
    one leaves), so b's arrays take the room of all of a's."""
    a, b = toks(2 * BS), toks(2 * BS, start=5000)
    with _store(device_budget_gb=0.01) as s:
        for p in (a, b):
            s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        s.fetch(M, a)
        arrays = s.stats()["device_bytes"]
    with _store(device_budget_gb=1.5 * arrays / (1 << 30)) as s:
        for p in (a, b):
            s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        s.fetch(M, a)
        s.fetch(M, b)
        st = s.stats()
        assert st["device_blocks"] == 2 and st["device_bytes"] == arrays <= st["device_budget"]
        assert_hit_is(s.fetch(M, a), a, 2 * BS, heads=2, dim=64)
        assert_hit_is(s.fetch(M, b), b, 2 * BS, heads=2, dim=64)


def test_conversations_sharing_a_prefix_are_counted_for_the_memory_they_hold(on_gpu):
    """Each conversation's hit copies the shared prefix into its own arrays;
    the older arrays stay while blocks of theirs are kept, and the budget
    says so: what it counts is what the kept blocks' arrays hold."""
    shared = toks(3 * BS)
    prompts = [shared + toks(BS, start=7000 + 1000 * i) for i in range(4)]
    with _store(device_budget_gb=0.01) as s:
        for p in prompts:
            s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        for p in prompts:
            assert_hit_is(s.fetch(M, p), p, 4 * BS, heads=2, dim=64)
            held = {id(d.arrays): d.arrays.nbytes for d in s._table.device._tier._blocks.values()}
            st = s.stats()
            assert st["device_bytes"] == sum(held.values()) <= st["device_budget"]
        assert len(held) > 1  # the first conversations' own blocks still hold their arrays


def test_trim_device_frees_the_copies_and_hits_go_on_from_ram(on_gpu):
    p = toks(3 * BS)
    with _store(device_budget_gb=0.01) as s:
        s.put(M, p, kv_layers(p))
        s.flush()
        s.fetch(M, p)
        assert s.stats()["device_blocks"] == 3
        s.trim_device(0)
        assert s.stats()["device_bytes"] == 0
        hit = s.fetch(M, p)
        assert_hit_is(hit, p, 3 * BS) and hit.ram_tokens == 3 * BS
        s.clear()  # blocks that leave the store leave the device with them
        assert s.stats()["device_blocks"] == 0


@pytest.mark.parametrize("landing", [1 << 30, 1], ids=["landed-at-once", "landed-block-by-block"])
def test_a_hit_of_blocks_two_hits_kept_is_copied_into_one_set_of_arrays_then_served_as_views(on_gpu, monkeypatch,
                                                                                              landing):
    """Blocks kept by one hit, beside blocks only in RAM: the next hit copies
    both into its own arrays (device to device, host to device) and keeps
    all of them there, so the hit after it copies nothing."""
    monkeypatch.setattr(cuda, "LANDING", landing)
    p = toks(4 * BS)
    with _store(device_budget_gb=0.01) as s:
        s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        stored = {k: s.held_bytes(k) for k in s.debug().ram_keys}  # (a block kept on the device leaves RAM)
        assert_hit_is(s.fetch(M, p[: 2 * BS] + [7]), p, 2 * BS, heads=2, dim=64)
        assert s.stats()["device_blocks"] == 2
        hit = s.fetch(M, p)
        assert_hit_is(hit, p, 4 * BS, heads=2, dim=64)
        assert s.stats()["device_blocks"] == 4
        rt = cuda.runtime()
        moved = getattr(rt, "copies", None)
        assert_hit_is(s.fetch(M, p), p, 4 * BS, heads=2, dim=64)
        assert moved is None or rt.copies == moved
        for d in list(s._table.device._tier._blocks.values()):  # a kept block's bytes, read back, are the stored ones
            assert bytes(d.to_stored().buf) == stored[d.key]


def test_blocks_from_disk_are_checked_staged_and_kept_and_a_bad_one_is_never_served(on_gpu, tmp_path):
    p = toks(4 * BS)
    with _store(device_budget_gb=0.01, ssd_path=tmp_path / "s") as s:
        s.put(M, p, kv_layers(p, heads=2, dim=64))
    _flip_last_byte(tmp_path / "s", KeyChain(root_key(M), as_tokens(p), BS).key(2))
    with _store(device_budget_gb=0.01, ssd_path=tmp_path / "s") as s:
        hit = s.fetch(M, p)
        assert_hit_is(hit, p, 2 * BS, heads=2, dim=64)
        assert hit.ssd_tokens == 2 * BS and s.stats()["corrupt_blocks"] == 1
        assert s.stats()["device_blocks"] == 2
        assert_hit_is(s.fetch(M, p), p, 2 * BS, heads=2, dim=64)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_hit_served_without_the_device_tier_owns_its_arrays(on_gpu, monkeypatch, bits):
    """Blocks land in a buffer the next hit reuses: what a hit hands over
    is copied out of it, so a later hit of other blocks changes nothing."""
    # dense: three blocks at a time; quantized, handed over as stored: a one-block hit, cut to views there
    monkeypatch.setattr(cuda, "LANDING", 3 * 2 * 2 * 2 * BS * 64 * 2)
    n = 4 * BS if bits is None else BS
    a, b = toks(n), toks(n, start=5000)
    q = None if bits is None else (bits, 32)
    with _store(device_budget_gb=0, kv_bits=bits, kv_group_size=32) as s:
        for p in (a, b):
            s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        first = s.fetch(M, a, quantized=q)
        before = [np.array(bits_of(x)) for x in _arrays_of(first)]
        assert s.fetch(M, b, quantized=q).length == n
        assert all(np.array_equal(x, bits_of(y)) for x, y in zip(before, _arrays_of(first)))
        if bits is None:
            assert_hit_is(first, a, n, heads=2, dim=64)
        assert s.stats()["device_blocks"] == 0


@pytest.mark.parametrize("layout", ["kinds", "layers"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_blocks_on_the_gpu_path_give_what_the_host_path_gives(on_gpu, tmp_path, monkeypatch, bits, layout):
    """Quantized blocks land on the GPU at their rows of every layer, each
    kind of array (data, scales, biases) by strided copies, and are
    dequantized there in one kernel: blocks laid out kind by kind (one copy
    per kind, as blocks are written now), laid out layer by layer (as older
    blocks are: a copy per array) and a short last block (its arrays padded
    apart); 4-bit keys are rotated, and those hits are cut block by block.
    From RAM, from the device tier, from disk and handed over quantized: the
    same arrays as the host path's, bit for bit."""
    monkeypatch.setattr(cuda, "LANDING", 2 * (1 << 20) // 1024)  # a few blocks at a time
    if layout == "layers":
        monkeypatch.setattr(wire._Layout, "layers", lambda self, ls, n: tuple(self.layer(l, n) for l in ls))
    p = toks(3 * BS + 5)
    rt = cuda.runtime()

    def on_host(fetch):
        """``fetch`` of a store of its own opened on the host backend (a store keeps the backend it opened on)."""
        monkeypatch.setattr(cuda, "runtime", lambda: None)
        try:
            with _store(budget_gb=1, kv_bits=bits, kv_group_size=32) as h:
                h.put(M, p, kv_layers(p, heads=2, dim=64))
                return fetch(h)
        finally:
            monkeypatch.setattr(cuda, "runtime", lambda: rt)

    def same_hit(a, b) -> bool:
        return a.length == b.length and all(np.array_equal(bits_of(x), bits_of(y))
                                            for x, y in zip(_arrays_of(a), _arrays_of(b)))

    kw = dict(device_budget_gb=0.01, ssd_path=tmp_path / "s", kv_bits=bits, kv_group_size=32)
    with _store(**kw) as s:
        s.put(M, p, kv_layers(p, heads=2, dim=64))
        s.flush()
        ref, qref = on_host(lambda h: h.fetch(M, p)), on_host(lambda h: h.fetch(M, p, quantized=(bits, 32)))
        assert same_hit(s.fetch(M, p), ref)  # from RAM
        assert s.stats()["device_blocks"] == 4
        kept = list(s._table.device._tier._blocks.values())
        assert all((d.arrays is not None and len(d.arrays.kinds) == 3) == (bits == 8) for d in kept)
        assert same_hit(s.fetch(M, p), ref)  # from the device tier
        assert same_hit(s.fetch(M, p, quantized=(bits, 32)), qref)
    with _store(**kw) as s:
        assert same_hit(s.fetch(M, p), ref)  # from disk


def _arrays_of(hit) -> list:
    return [x for l in hit.layers for t in (l.keys, l.values) for x in (t.arrays() if isinstance(t, Quantized) else [t])]


def _flip_last_byte(path, key: bytes) -> None:
    """Corrupt a block's value where it lies in the file (a large value is read at its recorded offset)."""
    env = lmdb.open(str(path), max_dbs=8, subdir=True, readonly=True)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        value = bytes(txn.get(key))
    env.close()
    data = (path / "data.mdb").read_bytes()
    at = data.index(value) + len(value) - 1
    assert data.find(value, at) == -1
    with open(path / "data.mdb", "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 1]))


def test_without_cuda_there_is_no_device_tier():
    if cuda.runtime() is not None:
        pytest.skip("a GPU is here")
    with _store(device_budget_gb=1) as s:
        assert s.stats()["device_budget"] == 0


def test_the_backend_is_chosen_from_the_runtime_installed_at_each_call(monkeypatch):
    """``choose()`` asks ``cuda.runtime()`` each time (a test's fake runtime
    switches it), and the device tier's budget follows the backend handed in."""
    from kvstore.config import GB, StoreConfig
    from kvstore.gpu.backend import choose

    rt = PinnedHostRuntime()
    monkeypatch.setattr(cuda, "runtime", lambda: rt)
    gpu = choose()
    assert gpu.apart and gpu.runtime is rt and gpu.name == "cuda" and choose() is gpu
    monkeypatch.setattr(cuda, "runtime", lambda: None)
    host = choose()
    assert not host.apart and host.runtime is None and host.name in ("cpu", "metal")
    assert host.device_memory() == 0
    cfg = StoreConfig(device_budget_gb=0.5)
    assert cfg.device_bytes(host) == 0 and cfg.device_bytes(gpu) == GB // 2


# ------------------------------------------------------------ tiers that hold different blocks (issue 54)


def _arrays_of_a_hit(p) -> int:
    """The GPU memory one hit of ``p`` keeps (its arrays, counted whole)."""
    with _store(device_budget_gb=0.01) as s:
        s.put(M, p, kv_layers(p))
        s.flush()
        s.fetch(M, p)
        return s.stats()["device_bytes"]


def test_a_block_kept_on_the_device_leaves_ram_so_both_budgets_hold_distinct_blocks(on_gpu):
    """RAM-only, RAM for one prompt's blocks, the device for one hit's arrays: a hit moves a's blocks to the
    device and out of RAM, so b, put next, fits in RAM without evicting a. Both are then hits: a from its device
    copies, b from RAM; b's hit takes the device, and a's evicted copies go back to RAM (a's in place of b's)."""
    a, b = toks(4 * BS), toks(4 * BS, start=5000)
    arrays = _arrays_of_a_hit(a)
    with _store(budget_gb=4.5 * BLOCK_BYTES / GB, device_budget_gb=1.5 * arrays / GB) as s:
        s.put(M, a, kv_layers(a))
        s.flush()
        assert_hit_is(s.fetch(M, a), a, 4 * BS)
        st = s.stats()
        assert (st["device_blocks"], st["ram_blocks"]) == (4, 0)
        s.put(M, b, kv_layers(b))
        s.flush()
        assert s.stats()["ram_blocks"] == 4  # b's, beside a's on the device: eight distinct blocks
        hit = s.fetch(M, a)
        assert_hit_is(hit, a, 4 * BS) and hit.device_tokens == 4 * BS
        hit = s.fetch(M, b)  # b to the device; a's copies evicted to make room go back to RAM
        assert_hit_is(hit, b, 4 * BS) and hit.device_tokens == 0
        s.flush()
        st = s.stats()
        assert st["device_blocks"] == 4 and st["ram_blocks"] == 4 and st["tokens_device"] == 4 * BS
        assert set(s.debug().device_keys).isdisjoint(s.debug().ram_keys)
        hit = s.fetch(M, a)
        assert_hit_is(hit, a, 4 * BS) and hit.device_tokens == 0 and hit.not_served == {}


def test_device_copies_trimmed_go_back_to_ram_unless_the_disk_holds_them(on_gpu, tmp_path):
    p = toks(3 * BS)
    with _store(device_budget_gb=0.01) as s:  # RAM-only: the device copy is the block's only one
        s.put(M, p, kv_layers(p))
        s.flush()
        s.fetch(M, p)
        assert (s.stats()["device_blocks"], s.stats()["ram_blocks"]) == (3, 0)
        s.trim_device(0)
        s.flush()
        assert (s.stats()["device_blocks"], s.stats()["ram_blocks"]) == (0, 3)
        assert_hit_is(s.fetch(M, p), p, 3 * BS)
    with _store(device_budget_gb=0.01, ssd_path=tmp_path / "s") as s:  # the disk holds them: no copy back
        s.put(M, p, kv_layers(p))
        s.flush()
        s.fetch(M, p)
        written = s.stats()["blocks_written"]
        s.trim_device(0)
        s.flush()
        st = s.stats()
        assert (st["device_blocks"], st["ram_blocks"], st["blocks_written"]) == (0, 0, written)
        hit = s.fetch(M, p)
        assert_hit_is(hit, p, 3 * BS) and hit.ssd_tokens == 3 * BS
