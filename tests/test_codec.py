"""Block codec: what goes in comes out bit for bit, and anything malformed,
truncated, corrupted or hostile is a ``BlockDecodeError``, found before any
allocation."""

from __future__ import annotations

import copy
import tracemalloc

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstore.blocks import header, wire
from kvstore.blocks.codec import BITS, GROUP_SIZES, Block, Codec, convert
from kvstore.errors import BlockDecodeError
from kvstore.blocks.header import KVSpec, read_header
from kvstore.blocks.layers import KVLayer, Quantized, StateLayer
from kvstore.blocks.wire import Stored, deserialize, serialize

from ._helpers import raw_header, repack, same, wire_prefix

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
RAW = {mx.float16: (np.uint16, mx.uint16), mx.bfloat16: (np.uint16, mx.uint16), mx.float32: (np.uint32, mx.uint32)}


def random_bits(rng: np.random.Generator, shape, dtype) -> mx.array:
    """Every bit pattern is possible: NaNs, infinities, subnormals, -0."""
    np_t, mx_t = RAW[dtype]
    raw = rng.integers(0, np.iinfo(np_t).max, size=shape, dtype=np_t, endpoint=True)
    return mx.array(raw).view(dtype)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**31 - 1, size=n, dtype=np.int64).astype(np.int32)


def roundtrip(block: Block, start: int = 0) -> Block:
    return deserialize(serialize(block), start)


def small_block() -> Block:
    """Rotated 4-bit keys, dense values, a state snapshot and an absent layer."""
    x = mx.random.normal((1, 1, 3, 32), key=mx.random.key(1)).astype(mx.float16)
    return Block(tokens(3), [KVLayer(convert(x, 4, 32, rotation=7), x, 0, None), StateLayer([x[0, 0], None]), None])


def check_well_formed(block: Block) -> None:
    """What a successful decode promises: every tensor usable as it claims."""
    assert block.tokens.dtype in (np.int32, np.int64)
    n = len(block.tokens)
    for layer in block.layers:
        if layer is None:
            continue
        if isinstance(layer, StateLayer):
            for a in layer.arrays:
                assert a is None or isinstance(a, mx.array)
            continue
        for t in (layer.keys, layer.values):
            assert t.shape[-2] == n
            if isinstance(t, Quantized):
                assert type(t.bits) is int and t.bits in BITS
                assert type(t.group_size) is int and t.group_size in GROUP_SIZES
                assert t.rotation is None or type(t.rotation) is int
                assert t.dequantize().shape == t.shape


# ------------------------------------------------------------------ round trip


@SETTINGS
@given(dtype=st.sampled_from(list(DTYPES)), heads=st.integers(1, 2), rows=st.integers(0, 9),
       dim=st.sampled_from([32, 64, 128]), start=st.integers(0, 1000), seed=st.integers(0, 2**32 - 1),
       window=st.none() | st.integers(1, 4096))
def test_dense_roundtrip_is_bit_exact(dtype, heads, rows, dim, start, seed, window):
    """Dense float16/bfloat16/float32 KV decodes to the same bits, shape and dtype."""
    rng = np.random.default_rng(seed)
    k = random_bits(rng, (1, heads, rows, dim), DTYPES[dtype])
    v = random_bits(rng, (1, heads, rows, dim), DTYPES[dtype])
    toks = tokens(rows, seed)
    out = roundtrip(Block(toks, [KVLayer(k, v, start, window)]), start)
    assert np.array_equal(out.tokens, toks) and out.tokens.dtype == np.int32
    (layer,) = out.layers
    assert same(layer.keys, k) and same(layer.values, v)
    assert layer.start == start and layer.window == window


@SETTINGS
@given(dtype=st.sampled_from(list(DTYPES)), bits=st.sampled_from(BITS), group_size=st.sampled_from(GROUP_SIZES),
       dim=st.sampled_from([32, 64, 128]), heads=st.integers(1, 2), rows=st.integers(1, 6),
       seed=st.integers(0, 2**32 - 1))
def test_quantized_roundtrip_equals_dequantize_of_quantize(dtype, bits, group_size, dim, heads, rows, seed):
    """A quantized tensor keeps its bits, group size and dtype, and decodes to
    exactly ``mx.dequantize(mx.quantize(x))``."""
    assume(dim % group_size == 0)
    x = mx.random.normal((1, heads, rows, dim), key=mx.random.key(seed)).astype(DTYPES[dtype])
    q = convert(x, bits, group_size)
    assert isinstance(q, Quantized) and (q.bits, q.group_size) == (bits, group_size)
    out = roundtrip(Block(tokens(rows), [KVLayer(q, q)])).layers[0]
    ref = mx.quantize(x, group_size=group_size, bits=bits)
    for t in (out.keys, out.values):
        assert isinstance(t, Quantized)
        assert (t.bits, t.group_size, t.dtype, t.shape) == (bits, group_size, DTYPES[dtype], x.shape)
        assert all(same(a, b) for a, b in zip(t.arrays(), ref))
        assert same(t.dequantize(), mx.dequantize(*ref, group_size=group_size, bits=bits))


@pytest.mark.parametrize("key_bits,value_bits", [(8, 4), (4, 8), (None, 4), (2, None), (3, 6)])
def test_keys_and_values_may_use_different_bits(key_bits, value_bits):
    """``Codec`` compresses keys and values separately; each keeps its own settings."""
    c = Codec(key_bits, value_bits, 64)
    k = mx.random.normal((1, 2, 5, 64), key=mx.random.key(2)).astype(mx.float16)
    v = mx.random.normal((1, 2, 5, 64), key=mx.random.key(3)).astype(mx.float16)
    out = roundtrip(Block(tokens(5), [KVLayer(c.compress_keys(k), c.compress_values(v))])).layers[0]
    for t, x, bits in ((out.keys, k, key_bits), (out.values, v, value_bits)):
        if bits is None:
            assert same(t, x)
        else:
            assert isinstance(t, Quantized) and t.bits == bits and t.group_size == 64
            assert same(t.dequantize(), mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits))


def test_codec_rejects_unsupported_settings():
    """Only bits in BITS and group sizes in GROUP_SIZES are accepted."""
    for bad in (1, 7, 16):
        with pytest.raises(ValueError):
            Codec.from_bits(bad)
    with pytest.raises(ValueError):
        Codec(4, 4, 16)
    assert Codec.from_bits((8, 4), rotate_values=False) == Codec(8, 4, 64)
    assert Codec.from_bits(None).describe() == "as given"


def test_convert_fits_the_group_to_the_head_dim():
    """The largest supported group size <= the wanted one that divides the head
    dim is used; a head dim none divides stays dense."""
    x = mx.random.normal((1, 1, 2, 32), key=mx.random.key(4)).astype(mx.float16)
    q = convert(x, 4, 128)
    assert isinstance(q, Quantized) and q.group_size == 32
    odd = mx.random.normal((1, 1, 2, 48), key=mx.random.key(5)).astype(mx.float16)
    assert convert(odd, 4, 64) is odd
    assert convert(q, 4, 32) is q  # already as wanted: untouched
    again = convert(q, 8, 32)  # other settings: through the dense values once
    assert isinstance(again, Quantized) and again.bits == 8
    assert same(again.dequantize(), convert(q.dequantize(), 8, 32).dequantize())


def test_state_snapshots_and_absent_layers_roundtrip():
    """StateLayer snapshots (with ``None`` slots) and absent (``None``) layers
    come back as they went in, in their place."""
    rng = np.random.default_rng(7)
    s1 = random_bits(rng, (1, 3, 16), mx.float32)
    s2 = mx.array(rng.integers(-5, 5, size=(2, 2), dtype=np.int32))
    s3 = random_bits(rng, (4,), mx.bfloat16)
    k = random_bits(rng, (1, 1, 4, 32), mx.float16)
    block = Block(tokens(4), [None, KVLayer(k, k, 8, 128), StateLayer([s1, None, s2]), None,
                              StateLayer([None, None]), StateLayer([s3])])
    out = roundtrip(block, 8)
    assert out.layers[0] is None and out.layers[3] is None
    assert isinstance(out.layers[1], KVLayer) and out.layers[1].start == 8 and out.layers[1].window == 128
    a, b, c = out.layers[2].arrays
    assert same(a, s1) and b is None and same(c, s2)
    assert out.layers[4].arrays == [None, None]
    assert same(out.layers[5].arrays[0], s3)
    assert out.nbytes == block.nbytes


@SETTINGS
@given(ids=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-5, 2**31 - 1), min_size=1, max_size=9),
       wide=st.booleans())
def test_token_ids_keep_their_value_at_the_width_they_need(ids, wide):
    """Token ids are signed 64-bit (mlx-lm keys image patches by ~60-bit
    negative ids): they come back exactly, stored as int32 when every id of
    the block fits, else int64, whatever width the block was built with."""
    toks = np.array(ids, np.int64 if wide or not all(-(2**31) <= i < 2**31 for i in ids) else np.int32)
    x = mx.zeros((1, 1, len(ids), 32), mx.float16)
    block = Block(toks, [KVLayer(x, x)])
    fits = all(-(2**31) <= i < 2**31 for i in ids)
    assert read_header(serialize(block)).tokens.dtype == ("int32" if fits else "int64")
    out = roundtrip(block)
    assert out.tokens.tolist() == ids and out.tokens.dtype == (np.int32 if fits else np.int64)
    assert block.tokens.dtype == out.tokens.dtype  # what the index records is what the payload holds


def test_empty_block_roundtrips():
    """A block with no tokens and no layers is still a valid block."""
    out = roundtrip(Block(np.zeros(0, np.int32), []))
    assert len(out.tokens) == 0 and out.layers == []


def test_serialized_layout_is_aligned():
    """Payload and every array in it start on a 64-byte boundary (mmap-friendly)."""
    buf = serialize(small_block())
    h = read_header(buf)
    assert h.payload_start % 64 == 0
    assert bytes(buf[:4]) == b"KVSB"
    offsets = [h.tokens.offset]
    for entry in h.layers:
        if isinstance(entry, KVSpec):
            offsets += [a.offset for t in (entry.keys, entry.values) for a in t.arrays]
    assert offsets and all(o % 64 == 0 for o in offsets)


# ------------------------------------------------------------------ rejection


def test_bad_magic_is_rejected():
    """A buffer that is not a kvstore block is refused by its magic."""
    buf = bytearray(serialize(small_block()))
    buf[:4] = b"NOPE"
    with pytest.raises(BlockDecodeError, match="magic"):
        read_header(bytes(buf))


@pytest.mark.parametrize("version", [0, 1, header.FORMAT_VERSION + 1, 0xFFFF])
def test_other_format_version_is_rejected(version):
    """Blocks of another format version are refused, naming the version."""
    buf = bytearray(serialize(small_block()))
    buf[4:6] = version.to_bytes(2, "little")
    with pytest.raises(BlockDecodeError, match="version"):
        deserialize(bytes(buf))


def test_rotated_tensor_in_a_version_2_block_is_rejected():
    """Version 2 predates rotation: a rotated tensor there is a forged header."""
    buf, fields = _fields()
    assert "r" in _kv(fields)["k"]
    with pytest.raises(BlockDecodeError, match="rotation"):
        deserialize(repack(buf, fields, version=2))
    del _kv(fields)["k"]["r"]  # the same header without it reads (as unrotated keys)
    assert deserialize(repack(buf, fields, version=2)).layers[0].keys.rotation is None


def test_every_truncation_is_rejected():
    """A torn value of any length (prefix, header, padding or payload cut) is refused."""
    buf = serialize(small_block())
    for n in range(len(buf)):
        with pytest.raises(BlockDecodeError):
            deserialize(buf[:n])
    with pytest.raises(BlockDecodeError):
        deserialize(bytes(buf) + b"\0" * 64)  # and so is trailing junk


def test_every_flipped_byte_is_caught():
    """Corrupting any single byte (prefix, header, padding, payload) is detected:
    by a field check, the header checksum or the payload checksum."""
    buf = serialize(small_block())
    deserialize(buf)
    for i in range(len(buf)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(buf)
            bad[i] ^= mask
            with pytest.raises(BlockDecodeError):
                deserialize(bytes(bad))


def test_payload_checksum_is_skipped_only_when_asked():
    """``verify=False`` trusts the payload (a fast path); the header is still validated."""
    buf = bytearray(serialize(small_block()))
    buf[-1] ^= 0xFF  # payload padding: only the checksum covers it
    with pytest.raises(BlockDecodeError, match="payload checksum"):
        deserialize(bytes(buf))
    deserialize(bytes(buf), verify=False)


def test_a_block_is_bound_to_its_key():
    """A block is read back only under the key it was written for: its rows
    depend on the tokens before it, which its own tokens do not show."""
    key, other = bytes(range(16)), bytes(range(1, 17))
    buf = serialize(small_block(), key)
    assert deserialize(buf, key=key).tokens.tolist() == small_block().tokens.tolist()
    with pytest.raises(BlockDecodeError, match="moved or overwritten"):
        deserialize(buf, key=other)
    with pytest.raises(BlockDecodeError, match="moved or overwritten"):
        deserialize(serialize(small_block()), key=key)  # an unbound block is no one's


def test_short_checksums_still_give_a_valid_block(monkeypatch):
    """``serialize`` places the payload before it knows the checksum; a
    checksum that packs shorter (below 2**32) still yields a block that reads
    back, whatever the header length."""
    real = xxhash.xxh3_64_intdigest

    class Short:
        @staticmethod
        def xxh3_64_intdigest(b):
            return real(b) & 0xFFFF

        class xxh3_64:  # the streamed checksum serialize takes while copying
            def __init__(self):
                self.h = xxhash.xxh3_64()

            def update(self, b):
                self.h.update(b)

            def intdigest(self):
                return self.h.intdigest() & 0xFFFF

    monkeypatch.setattr(wire, "xxhash", Short)
    monkeypatch.setattr(header, "xxhash", Short)
    x = mx.random.normal((1, 1, 80, 8), key=mx.random.key(2)).astype(mx.float16)
    starts = set()
    for n in range(1, 80):  # header lengths across several 64-byte boundaries
        key = bytes(n % 17)
        buf = serialize(Block(tokens(n), [KVLayer(x[..., :n, :], x[..., :n, :], 0, None)]), key)
        starts.add(read_header(buf).payload_start)
        back = deserialize(buf, key=key)
        assert back.tokens.tolist() == tokens(n).tolist()
        assert mx.array_equal(back.layers[0].keys, x[..., :n, :]).item()
    assert len(starts) > 1


def test_oversized_header_length_is_rejected():
    """A header length beyond MAX_HEADER or the buffer is refused before reading it."""
    buf = bytearray(serialize(small_block()))
    buf[8:12] = (header.MAX_HEADER + 1).to_bytes(4, "little")
    with pytest.raises(BlockDecodeError, match="header length"):
        read_header(bytes(buf))


# ------------------------------------------------------- hostile headers, fuzz


def _fields():
    buf = serialize(small_block())
    return buf, raw_header(buf)


def _kv(fields):
    return fields["L"][0]


HOSTILE = {
    "huge shape": lambda f: _kv(f)["v"].update(a=["float16", [2**40], 0, 2**41]),
    "huge zero-size shape": lambda f: _kv(f)["v"].update(a=["float16", [1, 2**39, 3, 0], 0, 0]),
    "int32-overflowing dim": lambda f: _kv(f)["v"].update(a=["float16", [1, 2**31, 3, 0], 0, 0]),
    "1 TB array": lambda f: _kv(f)["v"].update(a=["float32", [1, 1 << 18, 3, 1 << 20], 0, 3 << 40]),
    "1 TB token array": lambda f: f.update(n=1 << 38, tok=["int32", [1 << 38], 0, 1 << 40]),
    "negative dim": lambda f: _kv(f)["v"].update(a=["float16", [1, -1, 3, -32], 0, 192]),
    "float dim": lambda f: _kv(f)["v"].update(a=["float16", [1, 1.0, 3, 32], 0, 192]),
    "nine dims": lambda f: _kv(f)["v"].update(a=["float16", [1] * 9, 0, 2]),
    "unknown dtype": lambda f: _kv(f)["v"]["a"].__setitem__(0, "float64"),
    "dtype not a string": lambda f: _kv(f)["v"]["a"].__setitem__(0, ["float16"]),
    "dtype a map": lambda f: _kv(f)["v"]["a"].__setitem__(0, {"x": 1}),
    "bytes dtype": lambda f: _kv(f)["v"]["a"].__setitem__(0, b"float16"),
    "offset past the end": lambda f: _kv(f)["v"]["a"].__setitem__(2, 1 << 20),
    "offset misaligned": lambda f: _kv(f)["v"]["a"].__setitem__(2, _kv(f)["v"]["a"][2] + 2),
    "negative offset": lambda f: _kv(f)["v"]["a"].__setitem__(2, -64),
    "byte count past the end": lambda f: _kv(f)["v"]["a"].__setitem__(3, 1 << 30),
    "byte count not matching shape": lambda f: _kv(f)["v"]["a"].__setitem__(3, _kv(f)["v"]["a"][3] - 2),
    "rows not matching tokens": lambda f: f.update(n=2, tok=["int32", [2], 0, 8]),
    "bad bits": lambda f: _kv(f)["k"].update(q=[7, 32]),
    "float bits": lambda f: _kv(f)["k"].update(q=[4.0, 32]),
    "bool bits": lambda f: _kv(f)["k"].update(q=[True, 32]),
    "bad group size": lambda f: _kv(f)["k"].update(q=[4, 16]),
    "float group size": lambda f: _kv(f)["k"].update(q=[4, 32.0]),
    "bits not matching packing": lambda f: _kv(f)["k"].update(q=[8, 32]),
    "quantized parts missing": lambda f: _kv(f)["k"].update(a=_kv(f)["k"]["a"][:2]),
    "quantized data not uint32": lambda f: _kv(f)["k"]["a"][0].__setitem__(0, "int32"),
    "rotation of a dense tensor": lambda f: _kv(f)["v"].update(r=7),
    "rotation not an int": lambda f: _kv(f)["k"].update(r="7"),
    "rotation a float": lambda f: _kv(f)["k"].update(r=7.0),
    "rotation a bool": lambda f: _kv(f)["k"].update(r=True),
    "negative rotation": lambda f: _kv(f)["k"].update(r=-1),
    "zero window": lambda f: _kv(f).update(w=0),
    "string window": lambda f: _kv(f).update(w="8"),
    "no values": lambda f: _kv(f).pop("v"),
    "layer not a map": lambda f: f["L"].__setitem__(0, [1, 2]),
    "state not a list": lambda f: f["L"][1].update(s={"a": 1}),
    "layer table not a list": lambda f: f.update(L={"0": None}),
    "too many layers": lambda f: f.update(L=[None] * 4097),
    "token count negative": lambda f: f.update(n=-1),
    "token count a string": lambda f: f.update(n="3"),
    "payload size wrong": lambda f: f.update(size=f["size"] + 64),
    "payload checksum wrong": lambda f: f.update(sum=f["sum"] ^ 1),
    "payload checksum missing": lambda f: f.pop("sum"),
    "token array of floats": lambda f: f["tok"].__setitem__(0, "float32"),
    "token array of uint32": lambda f: f["tok"].__setitem__(0, "uint32"),
    "int64 token array of int32 size": lambda f: f["tok"].__setitem__(0, "int64"),
    "header not a map": lambda f: [1, 2, 3],
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_header_is_rejected(name):
    """A header with valid checksums but impossible content is a BlockDecodeError."""
    buf, fields = _fields()
    f = copy.deepcopy(fields)
    out = HOSTILE[name](f)
    f = out if isinstance(out, list) else f
    with pytest.raises(BlockDecodeError):
        deserialize(repack(buf, f))


def test_header_declaring_a_terabyte_fails_fast_without_allocating():
    """Validation runs before allocation: a 1 TB declared array costs nothing."""
    buf, fields = _fields()
    f = copy.deepcopy(fields)
    HOSTILE["1 TB array"](f)
    bad = repack(buf, f)
    tracemalloc.start()
    try:
        with pytest.raises(BlockDecodeError):
            deserialize(bad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # rejected from the header: nothing of that size allocated


@SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected(data):
    """Arbitrary bytes never decode and never raise anything but BlockDecodeError."""
    with pytest.raises(BlockDecodeError):
        deserialize(data)


@SETTINGS
@given(st.binary(max_size=256))
def test_valid_prefix_with_random_header_is_rejected(data):
    """A correct prefix (magic, version, checksum of the garbage) over a
    random header never gets further than BlockDecodeError."""
    with pytest.raises(BlockDecodeError):
        deserialize(wire_prefix(data) + data + bytes(200))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=10) | st.binary(max_size=10)
    | st.sampled_from(["float16", "bfloat16", "float32", "uint32", "int32", "float64", "q", "a", "s"])
    | st.sampled_from([2**31, 2**40, 2**62, -1, 0, 64, 4.0, 32.0]),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=3), children, max_size=4),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    """Every location in a decoded header (to pick one to mutate)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return obj


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_headers_fail_cleanly(data):
    """Hypothesis-mutated headers (any field replaced by any msgpack value,
    with valid checksums) either decode to a well-formed block or raise
    BlockDecodeError: never another exception."""
    buf, fields = _fields()
    f = copy.deepcopy(fields)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(f))
        path = data.draw(st.sampled_from(paths))
        f = _set(f, path, data.draw(msgpack_values))
    try:
        block = deserialize(repack(buf, f))
    except BlockDecodeError:
        return
    check_well_formed(block)


def test_a_packed_block_carries_the_header_a_reader_parses():
    """The writer keeps the header it wrote instead of parsing it back: it
    must be the header a reader of the same bytes gets."""
    block = small_block()
    held = Stored.pack(block, b"k" * 16, 0)
    parsed = Stored.of(bytes(held.buf), b"k" * 16, 0)
    assert held.header == parsed.header and held.checked and held.intact()
    assert held.decode().tokens.tolist() == block.tokens.tolist()


def test_a_large_block_is_serialized_64_bytes_into_a_page():
    """LMDB puts a value 16 bytes into its first page; glibc copies a
    page-aligned source there with a loop that faults once per 4 KiB of the
    map (4x slower on the CPU box), so large blocks start elsewhere in a page
    (64-byte aligned still), and read back exactly."""
    rows = 2048  # 2 layers x (K, V) x 8 heads x 2048 x 64 fp16 = 8 MiB
    layers = [KVLayer(mx.ones((1, 8, rows, 64), mx.float16) * i, mx.ones((1, 8, rows, 64), mx.float16), 0, None)
              for i in range(2)]
    block = Block(tokens(rows), layers)
    buf = serialize(block, b"k" * 16)
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    assert len(buf) > 1 << 20 and addr % 4096 == 64
    back = deserialize(buf, key=b"k" * 16)
    assert np.array_equal(back.tokens, block.tokens)
    assert all(same(b.keys, a.keys) and same(b.values, a.values) for a, b in zip(layers, back.layers))


def test_a_header_read_before_is_checked_again_once_its_bytes_change():
    """Headers are parsed and validated once per exact bytes (a hit reads the
    same blocks again and again): the same bytes give the same header, and any
    changed byte of the header, or a value of another length, is checked anew."""
    buf = bytearray(serialize(small_block(), b"k" * 16))
    first = read_header(bytes(buf))
    assert read_header(bytes(buf)) is first
    broken = bytearray(buf)
    broken[header.PREFIX.size + 2] ^= 0x40  # a byte of the msgpack header
    with pytest.raises(BlockDecodeError):
        read_header(bytes(broken))
    with pytest.raises(BlockDecodeError):
        read_header(bytes(buf) + bytes(64))  # the header's size no longer matches the value's
