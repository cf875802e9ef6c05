"""The one-copy read path (``kvstore.convert.gather``): blocks straight from their
stored bytes, or from RAM, into one tensor per layer. It must give exactly
what decoding every block and concatenating gives, cut a hit at a corrupt
block, and mix RAM and disk blocks in one prompt."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore import PrefixStore
from kvstore.blocks.codec import Block, Codec
from kvstore.convert.gather import _slow, gather
from kvstore.blocks.hashing import KeyChain, root_key
from kvstore.blocks.layers import KVLayer, Quantized, take_rows
from kvstore.blocks.wire import Stored, serialize

from ._helpers import bits_of, blocks_on_disk, kv_layers, raw_header, repack

BS = 16


def _blocks(tokens: np.ndarray, codec: Codec, heads: int = 2, dim: int = 64, dtype=mx.float16) -> list[Stored]:
    """The prompt's blocks as the LMDB tier would hand them over."""
    layers = kv_layers(tokens, n_layers=3, heads=heads, dim=dim, dtype=dtype)
    chain = KeyChain(root_key("m"), tokens, BS)
    out = []
    for i, s in enumerate(range(0, len(tokens), BS)):
        e = min(len(tokens), s + BS)
        kv = [KVLayer(codec.compress_keys(take_rows(l.keys, s, e)), codec.compress_values(take_rows(l.values, s, e)),
                      s) for l in layers]
        buf = memoryview(bytes(serialize(Block(tokens[s:e], kv), chain.key(i))))
        out.append(Stored.of(buf, chain.key(i), s))
    return out


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for t, u in ((x.keys, y.keys), (x.values, y.values)):
            if isinstance(t, Quantized):
                assert isinstance(u, Quantized) and t.settings == u.settings
                for p, q in zip(t.arrays(), u.arrays()):
                    assert np.array_equal(bits_of(p), bits_of(q))
            else:
                assert t.shape == u.shape and np.array_equal(bits_of(t), bits_of(u))


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("length", [64, 57, 16, 9])
def test_one_copy_read_equals_decoding_every_block(bits, length):
    """Full and partial last blocks, dense and quantized entries (dequantized
    for a dense engine): the same bits as decode + concatenate."""
    items = _blocks(np.arange(100, 164, dtype=np.int32), Codec.from_bits(bits))
    fast, slow = gather(items, length), _slow(items, length, None)
    assert fast.length == slow.length == length and fast.bad is None
    _same(fast.layers, slow.layers)


def test_bf16_rows_and_a_short_tail_block():
    items = _blocks(np.arange(7, 7 + 40, dtype=np.int32), Codec.from_bits(None), dtype=mx.bfloat16)
    _same(gather(items, 40).layers, _slow(items, 40, None).layers)


def test_quantized_engine_gets_the_stored_triples():
    """An engine running a quantized cache of the stored settings gets them as they are."""
    items = _blocks(np.arange(50, 98, dtype=np.int32), Codec.from_bits(8))
    got = gather(items, 40, quantized=(8, 64))
    assert all(isinstance(l.keys, Quantized) and l.keys.shape[-2] == 40 for l in got.layers)
    _same(got.layers, _slow(items, 40, (8, 64)).layers)


def test_ram_and_disk_blocks_mix_in_one_prompt():
    """Blocks from RAM (packed here, checksum known) and from disk (bytes
    read back, checksum not checked yet) in one hit."""
    items = _blocks(np.arange(300, 364, dtype=np.int32), Codec.from_bits(None))
    mixed = [Stored.pack(it.decode(), it.key, it.start) if i % 2 == 0 else it for i, it in enumerate(items)]
    assert [it.checked for it in mixed] == [True, False, True, False]
    _same(gather(mixed, 60).layers, _slow(items, 60, None).layers)


def test_a_corrupt_payload_is_reported_not_served():
    items = _blocks(np.arange(1, 65, dtype=np.int32), Codec.from_bits(None))
    raw = bytearray(items[2].buf)
    raw[-5] ^= 0xFF  # a payload byte: the header still reads, the checksum does not
    items[2] = Stored.of(bytes(raw), items[2].key, items[2].start)
    got = gather(items, 64)
    assert got.bad == 2 and got.length == 0 and not got.layers


def test_store_serves_a_prompt_part_from_ram_part_from_disk(tmp_path):
    """Through the store: the first blocks promoted to RAM by an earlier hit,
    the rest read from the LMDB file; the KV is the stored KV exactly."""
    toks = np.arange(1000, 1064, dtype=np.int32)
    want = kv_layers(toks, n_layers=2, heads=2, dim=32)
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "s", block_size=BS) as s:
        s.put("m", toks, want)
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "s", block_size=BS) as s:
        assert s.fetch("m", toks[:32]).ssd_tokens == 32
        s.flush()  # promotions done
        hit = s.fetch("m", toks)
        assert (hit.length, hit.ram_tokens, hit.ssd_tokens) == (64, 32, 32)
        for got, exp in zip(hit.layers, want):
            assert np.array_equal(bits_of(got.keys), bits_of(exp.keys))
            assert np.array_equal(bits_of(got.values), bits_of(exp.values))


def test_ram_holds_each_block_as_the_bytes_the_disk_stores(tmp_path):
    """The RAM tier keeps a block as its serialized value (what its budget
    counts, host memory on every backend), whether the writer just made it
    or a hit promoted it from disk (one copy, no decode); a hit from there
    is the stored KV exactly."""
    toks = np.arange(1000, 1064, dtype=np.int32)
    want = kv_layers(toks, n_layers=2, heads=2, dim=32)
    path = tmp_path / "s"

    with PrefixStore(budget_gb=1, ssd_path=path, block_size=BS) as s:
        s.put("m", toks, want)
        s.flush()
        keys = s.debug().ram_keys
        made, nbytes = {k: s.held_bytes(k) for k in keys}, s.nbytes
    on_disk = blocks_on_disk(path)
    assert len(keys) == 4 and nbytes == sum(len(on_disk[k]) for k in keys)
    assert all(made[k] == on_disk[k] for k in keys)
    with PrefixStore(budget_gb=1, ssd_path=path, block_size=BS) as s:
        assert s.nbytes == 0 and s.debug().ram_keys == () and s.fetch("m", toks).ssd_tokens == 64
        s.flush()  # promotions done
        assert sorted(s.debug().ram_keys) == sorted(keys)
        assert all(s.held_bytes(k) == on_disk[k] for k in keys)
        hit = s.fetch("m", toks)
        assert hit.ram_tokens == 64
        for got, exp in zip(hit.layers, want):
            assert np.array_equal(bits_of(got.keys), bits_of(exp.keys))
            assert np.array_equal(bits_of(got.values), bits_of(exp.values))


def test_the_checksum_taken_while_copying_is_the_whole_payloads():
    """The host path hashes a block's payload array by array as it copies:
    where a header lays an array inside an earlier one (a writer kvstore does
    not have, but a valid header all the same), every payload byte is still
    hashed once, so an intact block is served as the slow path serves it."""
    item = _blocks(np.arange(100, 116, dtype=np.int32), Codec.from_bits(8))[0]
    fields = raw_header(item.buf)
    data, scales, _ = fields["L"][1]["k"]["a"]
    scales[2] = data[2]  # layer 1's key scales read from the start of its key data: inside it, offsets in order
    odd = Stored.of(memoryview(repack(item.buf, fields)), item.key, 0)
    assert odd.intact()
    fast, slow = gather([odd], BS), _slow([odd], BS, None)
    assert fast.bad is None and fast.length == BS
    _same(fast.layers, slow.layers)
