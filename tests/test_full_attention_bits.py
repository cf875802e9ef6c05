"""``full_attention_bits``: the full-attention layers of a model that also has
sliding-window layers (Gemma 3's global ones) kept another way than the
windowed ones. Each layer's tensors record their own settings in the block
header, so such blocks are written in the existing format versions and read
back as they were kept by every reader of them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore.blocks.codec import Block, Codec
from kvstore.errors import ConfigError
from kvstore.blocks.header import read_header
from kvstore.blocks.layers import KVLayer, Quantized
from kvstore.blocks.rotation import DEFAULT_SEED
from kvstore.store import PrefixStore
from kvstore.blocks.wire import deserialize, serialize

M = "full-attention-bits-model"
N, WINDOW = 24, 8


def kv(seed: int, rows: int = N, dim: int = 64) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(1, 2, rows, dim)).astype(np.float16))


def gemma_like(rows: int = N) -> list[KVLayer]:
    """Two windowed layers, then a full-attention one (the cold cache's layers)."""
    return [KVLayer(kv(1, rows), kv(2, rows), 0, WINDOW), KVLayer(kv(3, rows), kv(4, rows), 0, WINDOW),
            KVLayer(kv(5, rows), kv(6, rows), 0, None)]


def test_codec_settings():
    """Spelled as kv_bits; "same" (the default) keeps no override; the full-attention codec has the
    store's group size and rotation choices, an explicit rotation applying only where its bits quantize."""
    assert Codec.from_bits(8).full_attention is None
    c = Codec.from_bits(8, 32, True, True, full_attention_bits=None)
    assert c.full_attention == Codec(None, None, 32, False, False)
    assert c.describe() == "K8r/V8r g32; full-attention layers of windowed models: as given"
    assert Codec.from_bits(4, full_attention_bits=8).full_attention == Codec(8, 8, 64, False, False)
    assert Codec.from_bits(4, full_attention_bits=(8, 4)).full_attention == Codec(8, 4, 64, False, True)
    assert Codec.from_bits(4, 32, True, True, full_attention_bits=(8, None)).full_attention == \
        Codec(8, None, 32, True, False)
    for bad in (7, "dense", (8,), True, 8.0):
        with pytest.raises(ConfigError, match="full_attention_bits"):
            Codec.from_bits(8, full_attention_bits=bad)
    with pytest.raises(ConfigError):
        PrefixStore(budget_gb=0.01, kv_bits=8, full_attention_bits=7)


def test_for_layer_picks_the_full_attention_codec_only_in_a_windowed_model():
    c = Codec.from_bits(8, full_attention_bits=None)
    assert c.for_layer(None, windowed_model=True) is c.full_attention
    assert c.for_layer(WINDOW, windowed_model=True) is c
    assert c.for_layer(None, windowed_model=False) is c  # a plain llama: every layer as kv_bits says


def test_a_block_mixing_settings_records_each_layer_and_reads_back_as_kept():
    """Dense and quantized layers in one block: the header says per tensor, no rotation keeps the
    format at version 2 (read by older kvstores), decoding gives each layer back as it was kept."""
    c = Codec.from_bits(8, full_attention_bits=None)
    layers = gemma_like()
    kept = [KVLayer(c.for_layer(l.window, True).compress_keys(l.keys),
                    c.for_layer(l.window, True).compress_values(l.values), 0, l.window) for l in layers]
    block = Block(np.arange(N, dtype=np.int32), kept)
    assert block.describe() == ("K8/V8 g64 + dense", "float16")
    buf = serialize(block)
    assert int.from_bytes(buf[4:6], "little") == 2
    entries = read_header(buf).layers
    assert [(e.keys.bits, e.keys.group_size, e.values.bits) for e in entries] == [(8, 64, 8), (8, 64, 8),
                                                                                   (None, None, None)]
    back = deserialize(buf).layers
    assert isinstance(back[0].keys, Quantized) and isinstance(back[1].values, Quantized)
    assert np.array_equal(np.array(back[2].keys), np.array(layers[2].keys))
    assert np.array_equal(np.array(back[2].values), np.array(layers[2].values))


@pytest.mark.parametrize("reopen", [False, True])
def test_store_keeps_full_attention_layers_dense_and_windowed_ones_quantized(tmp_path, reopen):
    """Through the store (RAM, or LMDB after a restart with other settings): the full-attention
    layer comes back bit-exact, each windowed one with its window's rows exactly as rotated q8
    keeps them (8 bits rotate only when asked)."""
    kw = dict(budget_gb=0.1, ssd_path=tmp_path / "s", block_size=8, fetch_policy="always")
    layers, toks = gemma_like(), list(range(100, 100 + N))
    c = Codec.from_bits(8, rotate_keys=True, rotate_values=True)
    with PrefixStore(kv_bits=8, rotate_keys=True, rotate_values=True, full_attention_bits=None, **kw) as s:
        assert s.put(M, toks, layers) == N // 8
        s.flush()
        if not reopen:
            hit = s.fetch(M, toks)
    if reopen:
        with PrefixStore(kv_bits=4, **kw) as s:  # entries remember their own settings
            hit = s.fetch(M, toks)
    assert hit.length == N
    for got, want in zip(hit.layers, layers):
        if want.window is None:
            assert got.start == 0 and got.window is None
            assert np.array_equal(np.array(got.keys), np.array(want.keys))
            assert np.array_equal(np.array(got.values), np.array(want.values))
        else:
            assert got.start == N - WINDOW and got.window == WINDOW
            for a, t, comp in ((got.keys, want.keys, c.compress_keys), (got.values, want.values, c.compress_values)):
                q = comp(t[..., N - WINDOW:, :])
                assert q.settings == (8, 64, DEFAULT_SEED)
                assert np.array_equal(np.array(a), np.array(q.dequantize()))
                assert not np.array_equal(np.array(a), np.array(t[..., N - WINDOW:, :]))


def test_a_model_without_windows_keeps_every_layer_as_kv_bits(tmp_path):
    layers = [KVLayer(kv(1), kv(2), 0, None), KVLayer(kv(3), kv(4), 0, None)]
    toks = list(range(N))
    with PrefixStore(budget_gb=0.1, block_size=8, kv_bits=8, full_attention_bits=None, fetch_policy="always") as s:
        s.put(M, toks, layers)
        s.flush()
        hit = s.fetch(M, toks, quantized=(8, 64))
    assert all(isinstance(l.keys, Quantized) and l.keys.bits == 8 for l in hit.layers)
