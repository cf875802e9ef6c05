"""Rotated keys and values: a fixed orthogonal Hadamard transform with seeded
sign flips before quantizing, undone on restore; recorded per tensor in the
block header."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from kvstore.blocks.codec import Block, Codec, convert
from kvstore.config import StoreConfig
from kvstore.blocks.header import read_header
from kvstore.blocks.layers import KVLayer, Quantized
from kvstore.blocks.rotation import DEFAULT_SEED, rotatable, rotate, signs, unrotate
from kvstore.store import PrefixStore
from kvstore.blocks.wire import deserialize, serialize

M = "rotation-test-model"


def outlier_keys(rows: int = 64, dim: int = 64, heads: int = 2, seed: int = 0) -> mx.array:
    """Keys like a trained model's: most channels small, a few (RoPE pairs) very large."""
    rng = np.random.default_rng(seed)
    k = rng.normal(0, 1, size=(1, heads, rows, dim)).astype(np.float32)
    k[..., [3, 4, dim - 5]] *= 25.0
    return mx.array(k).astype(mx.float16)


def err(a: mx.array, b: mx.array) -> float:
    return float(mx.sqrt(mx.mean(mx.square(a.astype(mx.float32) - b.astype(mx.float32)))))


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_rotate_then_unrotate_is_close_to_identity(dim):
    """fp16 keys come back within fp16 rounding, and the transform keeps
    lengths and dot products (it is orthogonal), so attention scores survive."""
    k = outlier_keys(dim=dim)
    y = rotate(k, DEFAULT_SEED)
    assert y.dtype == mx.float16 and y.shape == k.shape
    back = unrotate(y, DEFAULT_SEED)
    assert float(mx.max(mx.abs(back - k))) <= 2e-3 * float(mx.max(mx.abs(k)))
    kf, yf = k.astype(mx.float32), y.astype(mx.float32)
    q = outlier_keys(rows=8, dim=dim, seed=1).astype(mx.float32)
    scores = q @ kf.swapaxes(-1, -2)
    rotated_scores = rotate(q, DEFAULT_SEED) @ yf.swapaxes(-1, -2)
    assert np.allclose(np.array(rotated_scores), np.array(scores), rtol=1e-2, atol=0.5)
    assert np.allclose(np.array(mx.linalg.norm(yf, axis=-1)), np.array(mx.linalg.norm(kf, axis=-1)), rtol=2e-3)


def test_signs_are_fixed_by_the_seed():
    """The sign flips depend on the seed alone (xxh3 over explicit bytes): the
    same in every process and release, else stored blocks would restore wrong.
    The digest pins the default seed's pattern."""
    s = np.array(signs(DEFAULT_SEED, 128))
    assert set(np.unique(s)) == {-1.0, 1.0}
    assert 40 < (s > 0).sum() < 88
    assert np.array_equal(np.array(signs(DEFAULT_SEED, 64)), s[:64])
    assert not np.array_equal(np.array(signs(DEFAULT_SEED + 1, 128)), s)
    assert xxhash.xxh3_64_hexdigest(s.tobytes()) == "90d73bf21ea3918e"


def test_rotated_q4_keys_restore_with_less_error_than_plain_q4():
    """Outlier channels set a whole group's scale in plain q4; rotated, they
    spread over the group and the other channels keep their precision."""
    k = outlier_keys()
    plain = convert(k, 4, 64)
    rotated = convert(k, 4, 64, rotation=DEFAULT_SEED)
    assert plain.rotation is None and rotated.rotation == DEFAULT_SEED
    e_plain, e_rot = err(plain.dequantize(), k), err(rotated.dequantize(), k)
    assert e_rot < 0.6 * e_plain, (e_rot, e_plain)


def test_a_rotated_block_roundtrips_through_its_header():
    """The seed is recorded beside bits and group size; the block is format
    version 3, a block without rotation stays version 2 (older readers keep
    reading it), and decoding gives back the same arrays and the same keys."""
    k = outlier_keys(rows=5)
    q = convert(k, 4, 64, rotation=DEFAULT_SEED)
    block = Block(np.arange(5, dtype=np.int32), [KVLayer(q, k, 0, None)])
    assert block.describe() == ("K4r/V16 g64", "float16")  # what `kvstore inspect` shows
    buf = serialize(block)
    assert int.from_bytes(buf[4:6], "little") == 3
    entry = read_header(buf).layers[0]
    assert (entry.keys.bits, entry.keys.group_size, entry.keys.rotation) == (4, 64, DEFAULT_SEED)
    assert entry.values.bits is None and entry.values.rotation is None
    back = deserialize(buf).layers[0].keys
    assert isinstance(back, Quantized) and back.settings == (4, 64, DEFAULT_SEED)
    for a, b in zip(back.arrays(), q.arrays()):
        assert np.array_equal(np.array(a), np.array(b))
    assert np.array_equal(np.array(back.dequantize()), np.array(q.dequantize()))

    plain = serialize(Block(np.arange(5, dtype=np.int32), [KVLayer(convert(k, 4, 64), k, 0, None)]))
    assert int.from_bytes(plain[4:6], "little") == 2
    assert read_header(plain).layers[0].keys.rotation is None
    assert deserialize(plain).layers[0].keys.rotation is None


def test_convert_keeps_plain_quantized_input_and_unrotates_on_request():
    """An engine's own q4 cache is kept as it is (quantizing again only adds
    error); asking for plain rows of rotated ones gives plain rows (what an
    engine's QuantizedKVCache attends to)."""
    k = outlier_keys()
    plain = convert(k, 4, 64)
    assert convert(plain, 4, 64, rotation=DEFAULT_SEED) is plain
    rotated = convert(k, 4, 64, rotation=DEFAULT_SEED)
    assert convert(rotated, 4, 64, rotation=DEFAULT_SEED) is rotated
    unrot = convert(rotated, 4, 64)
    assert unrot.rotation is None
    assert err(unrot.dequantize(), k) < 1.2 * err(plain.dequantize(), k) + err(rotated.dequantize(), k)


def test_head_dims_that_are_not_powers_of_two_stay_unrotated():
    """A dim with no symmetric Hadamard matrix is quantized plain (and says so)."""
    assert not rotatable(96) and rotatable(64)
    k = mx.random.normal((1, 1, 4, 96)).astype(mx.float16)
    q = convert(k, 4, 32, rotation=DEFAULT_SEED)
    assert q.rotation is None


def test_codec_settings():
    """rotate_keys needs quantized keys; from_bits turns it on by default for
    keys of StoreConfig.rotate_keys_at_or_below bits or fewer only."""
    with pytest.raises(ValueError, match="rotate_keys"):
        Codec(None, 8, 64, rotate_keys=True)
    limit = StoreConfig().rotate_keys_at_or_below
    for bits in (8, 6, 4, 3):
        auto = Codec.from_bits(bits).rotate_keys
        assert auto == (limit is not None and bits <= limit)
        assert Codec.from_bits(bits, rotate_keys=True).rotate_keys
        assert not Codec.from_bits(bits, rotate_keys=False).rotate_keys
    assert not Codec.from_bits(None).rotate_keys
    assert Codec.from_bits((4, 8), rotate_keys=True).describe() == "K4r/V8 g64"


def test_rotated_keys_restored_through_a_store_equal_what_was_stored(tmp_path):
    """Through a reopened on-disk store, keys come back as the rotated q4
    entry's own dequantized values (within q4 error of the originals), in one
    piece across blocks; an engine asking for q4 gets plain q4 rows."""
    toks = list(range(100, 150))
    layers = [KVLayer(outlier_keys(rows=50, seed=s), outlier_keys(rows=50, seed=s + 9)) for s in range(2)]
    with PrefixStore(budget_gb=1, block_size=16, ssd_path=tmp_path, kv_bits=4, rotate_keys=True) as store:
        assert store.put(M, toks, layers) == 4
    with PrefixStore(budget_gb=1, block_size=16, ssd_path=tmp_path, kv_bits=4, rotate_keys=False) as store:
        hit = store.fetch(M, toks)
        assert hit.length == 50 and hit.ssd_tokens == 50
        for got, want in zip(hit.layers, layers):
            stored = [convert(want.keys[..., a:a + 16, :], 4, 64, rotation=DEFAULT_SEED) for a in range(0, 50, 16)]
            expect = mx.concatenate([q.dequantize() for q in stored], axis=-2)
            assert np.array_equal(np.array(got.keys), np.array(expect))
            assert err(got.keys, want.keys) < 0.6 * err(convert(want.keys, 4, 64).dequantize(), want.keys)
        q = store.fetch(M, toks, quantized=(4, 64))
        keys = q.layers[0].keys
        assert isinstance(keys, Quantized) and keys.rotation is None
        plain_err = err(convert(layers[0].keys, 4, 64).dequantize(), layers[0].keys)
        assert err(keys.dequantize(), layers[0].keys) < plain_err + err(hit.layers[0].keys, layers[0].keys)


# ------------------------------------------------------------------ rotated values


def attend(keys: mx.array, values: mx.array, seed: int = 3) -> mx.array:
    """Softmax attention of a few fixed queries over ``keys`` / ``values`` (float32)."""
    q = mx.array(np.random.default_rng(seed).normal(0, 1, size=(1, keys.shape[1], 4, keys.shape[-1])), mx.float32)
    k, v = keys.astype(mx.float32), values.astype(mx.float32)
    w = mx.softmax((q @ k.swapaxes(-1, -2)) / np.sqrt(k.shape[-1]), axis=-1)
    return w @ v


def test_rotated_q4_values_restore_closer_than_plain_q4_and_so_does_attention():
    """Values with outlier channels: rotated before q4 they come back nearer
    the originals, and since attention output is linear in V, so does it."""
    k, v = outlier_keys(seed=4), outlier_keys(seed=5)
    plain = convert(v, 4, 64)
    rotated = convert(v, 4, 64, rotation=DEFAULT_SEED)
    assert plain.rotation is None and rotated.rotation == DEFAULT_SEED
    e_plain, e_rot = err(plain.dequantize(), v), err(rotated.dequantize(), v)
    assert e_rot < 0.6 * e_plain, (e_rot, e_plain)
    cold = attend(k, v)
    a_plain, a_rot = err(attend(k, plain.dequantize()), cold), err(attend(k, rotated.dequantize()), cold)
    assert a_rot < 0.7 * a_plain, (a_rot, a_plain)


def test_codec_rotates_values_when_asked_and_by_its_default_rule():
    """rotate_values needs quantized values; from_bits applies
    StoreConfig.rotate_values_at_or_below when it is None; the codec quantizes keys and
    values with their own rotation and says so."""
    with pytest.raises(ValueError, match="rotate_values"):
        Codec(8, None, 64, rotate_values=True)
    limit = StoreConfig().rotate_values_at_or_below
    for bits in (8, 6, 4, 3):
        assert Codec.from_bits(bits).rotate_values == (limit is not None and bits <= limit)
        assert Codec.from_bits((8, bits)).rotate_values == (limit is not None and bits <= limit)
        assert Codec.from_bits(bits, rotate_values=True).rotate_values
        assert not Codec.from_bits(bits, rotate_values=False).rotate_values
    assert not Codec.from_bits(None).rotate_values and not Codec.from_bits((4, None)).rotate_values
    c = Codec.from_bits(4, rotate_keys=True, rotate_values=True)
    assert c.describe() == "K4r/V4r g64"
    assert Codec.from_bits((8, 4), rotate_keys=False, rotate_values=True).describe() == "K8/V4r g64"
    v = outlier_keys(seed=6)
    assert c.compress_values(v).rotation == DEFAULT_SEED
    assert Codec.from_bits(4, rotate_values=False).compress_values(v).rotation is None
    assert Codec.from_bits(4, rotate_keys=False, rotate_values=True).compress_keys(v).rotation is None


@pytest.mark.parametrize("rotate_keys", [False, True])
def test_a_block_with_rotated_values_records_them_per_tensor(rotate_keys):
    """Values carry their own "r" in the header (keys only when rotated too);
    any rotated tensor makes the block format version 3; decoding gives back
    the same arrays and settings."""
    k, v = outlier_keys(rows=7, seed=1), outlier_keys(rows=7, seed=2)
    c = Codec.from_bits((8, 4), rotate_keys=rotate_keys, rotate_values=True)
    block = Block(np.arange(7, dtype=np.int32), [KVLayer(c.compress_keys(k), c.compress_values(v), 0, None)])
    assert block.describe() == (f"K8{'r' if rotate_keys else ''}/V4r g64", "float16")
    buf = serialize(block)
    assert int.from_bytes(buf[4:6], "little") == 3
    entry = read_header(buf).layers[0]
    assert (entry.values.bits, entry.values.group_size, entry.values.rotation) == (4, 64, DEFAULT_SEED)
    assert (entry.keys.bits, entry.keys.group_size) == (8, 64)
    assert entry.keys.rotation == (DEFAULT_SEED if rotate_keys else None)
    back = deserialize(buf).layers[0]
    assert back.values.settings == (4, 64, DEFAULT_SEED)
    assert back.keys.settings == (8, 64, DEFAULT_SEED if rotate_keys else None)
    for a, b in zip(back.values.arrays(), block.layers[0].values.arrays()):
        assert np.array_equal(np.array(a), np.array(b))
    assert err(back.values.dequantize(), v) < 0.6 * err(convert(v, 4, 64).dequantize(), v)


@pytest.mark.parametrize("reopen", [False, True])
def test_rotated_values_restored_through_a_store_equal_what_was_stored(tmp_path, reopen):
    """From the RAM tier and through a reopened on-disk store, values come
    back as the rotated q4 entries' own dequantized (unrotated) values, in one
    piece across blocks, nearer the originals than plain q4 ones; an engine
    asking for q4 gets plain (unrotated) q4 values; the mlx-lm adapter builds
    a dense cache holding the unrotated rows."""
    from mlx_lm.models import cache as C

    from kvstore.adapters.mlx_lm import layers_to_cache

    toks = list(range(200, 250))
    layers = [KVLayer(outlier_keys(rows=50, seed=s), outlier_keys(rows=50, seed=s + 20)) for s in range(2)]
    kw = dict(budget_gb=1, block_size=16, ssd_path=tmp_path, kv_bits=4, rotate_keys=True, rotate_values=True)
    store = PrefixStore(**kw)
    try:
        assert store.put(M, toks, layers) == 4
        if reopen:
            store.close()
            store = PrefixStore(**dict(kw, rotate_values=False))  # entries keep their own settings
        hit = store.fetch(M, toks)
        assert hit.length == 50 and hit.ssd_tokens == (50 if reopen else 0)
        for got, want in zip(hit.layers, layers):
            stored = [convert(want.values[..., a:a + 16, :], 4, 64, rotation=DEFAULT_SEED) for a in range(0, 50, 16)]
            expect = mx.concatenate([q.dequantize() for q in stored], axis=-2)
            assert np.array_equal(np.array(got.values), np.array(expect))
            assert err(got.values, want.values) < 0.6 * err(convert(want.values, 4, 64).dequantize(), want.values)
            cold = attend(want.keys, want.values)
            assert err(attend(got.keys, got.values), cold) < err(
                attend(convert(want.keys, 4, 64).dequantize(), convert(want.values, 4, 64).dequantize()), cold)
        q = store.fetch(M, toks, quantized=(4, 64))
        values = q.layers[0].values
        assert isinstance(values, Quantized) and values.rotation is None
        plain_err = err(convert(layers[0].values, 4, 64).dequantize(), layers[0].values)
        assert err(values.dequantize(), layers[0].values) < plain_err + err(hit.layers[0].values, layers[0].values)

        class TwoLayers:  # what make_prompt_cache needs of a model: its layers
            layers = [None, None]

        cache = layers_to_cache(hit.layers, TwoLayers(), length=50)
        assert all(type(c) is C.KVCache and c.offset == 50 for c in cache)
        for c, got in zip(cache, hit.layers):
            assert np.array_equal(np.array(c.values[..., :50, :]), np.array(got.values))
            assert np.array_equal(np.array(c.keys[..., :50, :]), np.array(got.keys))
    finally:
        store.close()
