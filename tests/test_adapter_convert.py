"""mlx-lm adapter, conversion half: prompt cache -> layers -> prompt cache.

Tiny real mlx-lm models are built in-process (fixed seed, float16 weights like
a real checkpoint); each test prefills a prompt, converts the cache to store
layers, cuts them the way the store serves a fetch, rebuilds a cache and feeds
the same next tokens to the engine's cache and the rebuilt one.

Tolerances: where the rebuilt cache holds the same rows in the same buffer
order as the engine's, the model runs the same kernels on the same bytes, so
logits must be *bit-identical* (``array_equal``). Three comparisons are not
bit-identical by construction and use a tolerance:

* a prefix served from a longer prefill vs. an engine that prefilled only the
  prefix (the prefill matmuls ran over another number of rows), and the
  chunked cache (the rebuilt buffer is shorter than the engine's, whose extra
  rows are masked out): a few float16 ulps of |logits| ~ 5, atol 2e-2. These
  are observed bit-exact on mlx CPU, but no kernel promises it.
* a ring that rotated during decoding vs. its rebuilt temporal-order copy:
  same rows, another reduction order (float32 model, atol 1e-4; observed
  ~1e-5, a wrong or missing row shows up as ~1e-1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import baichuan_m1, gemma3_text, llama, llama4, qwen3, qwen3_next
from mlx_lm.models import cache as C

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvstore.adapters.mlx_lm import (  # noqa: E402
    cache_layout,
    cache_offset,
    cache_to_layers,
    layers_to_cache,
    layout_signature,
    model_fingerprint,
)
from kvstore.blocks.layers import KVLayer, Quantized, StateLayer, take_rows  # noqa: E402

from ._helpers import MLX_LM, keys_and_values  # noqa: E402

VOCAB = 512
CLOSE = dict(atol=2e-2, rtol=0)

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

_GEMMA3 = dict(_COMMON, model_type="gemma3_text", num_hidden_layers=4, sliding_window=32,
               sliding_window_pattern=2, query_pre_attn_scalar=64)

CONFIGS = {
    "llama": (
        llama,
        dict(_COMMON, model_type="llama", num_hidden_layers=2, hidden_size=256,
             num_attention_heads=4, num_key_value_heads=2),
        mx.float16,
    ),
    # No make_cache(): the one kind whose make_prompt_cache honours max_kv_size.
    "qwen3": (
        qwen3,
        dict(_COMMON, model_type="qwen3", num_hidden_layers=2, rope_theta=1e6,
             max_position_embeddings=4096),
        mx.float16,
    ),
    "gemma3_text": (gemma3_text, _GEMMA3, mx.float16),
    "qwen3_next": (
        qwen3_next,
        dict(_COMMON, model_type="qwen3_next", num_hidden_layers=4,
             full_attention_interval=2, rope_theta=1e7, partial_rotary_factor=0.25,
             max_position_embeddings=4096, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=2,
             decoder_sparse_step=1, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, mlp_only_layers=[], norm_topk_prob=True),
        mx.float16,
    ),
    "gemma3_text_f32": (gemma3_text, _GEMMA3, mx.float32),
    # CacheList(ArraysCache, RotatingKVCache | KVCache) per layer.
    "baichuan_m1": (
        baichuan_m1,
        dict(_COMMON, model_type="baichuan_m1", num_hidden_layers=2, rope_theta=1e4,
             sliding_window=32, sliding_window_layers=[0], conv_window=2),
        mx.float16,
    ),
    # ChunkedKVCache x3 + KVCache; float32 because mlx's CPU GatherMM (MoE) is f32-only.
    "llama4": (
        llama4,
        dict(model_type="llama4", text_config=dict(
            _COMMON, model_type="llama4_text", attention_bias=False,
            attention_chunk_size=16, interleave_moe_layer_step=2,
            intermediate_size_mlp=256, max_position_embeddings=4096,
            num_experts_per_tok=1, num_hidden_layers=4, num_local_experts=2,
            rope_scaling=None, rope_theta=1e4, use_qk_norm=True)),
        mx.float32,
    ),
}

_MODELS: dict = {}


def model(name: str):
    """Tiny model, built once per session with a fixed seed."""
    if name not in _MODELS:
        mod, args, dtype = CONFIGS[name]
        mx.random.seed(0)
        m = mod.Model(mod.ModelArgs.from_dict(args))
        if name == "baichuan_m1":
            # The conv taps start at zero (keys would all be 0): randomize them
            # so the ArraysCache state actually matters.
            for layer in m.model.layers:
                a = layer.self_attn
                a.conv_k = mx.random.normal(a.conv_k.shape) * 0.5
                a.conv_v = mx.random.normal(a.conv_v.shape) * 0.5
        m.set_dtype(dtype)
        mx.eval(m.parameters())
        _MODELS[name] = m
    return _MODELS[name]


def toks(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def prefill(m, tokens: list[int], prompt_cache=None):
    """One-shot prefill, as the engine does for a prompt shorter than its step."""
    prompt_cache = C.make_prompt_cache(m) if prompt_cache is None else prompt_cache
    mx.eval(m(mx.array([tokens]), cache=prompt_cache))
    return prompt_cache


def feed(m, prompt_cache, chunks: list[list[int]]) -> list[mx.array]:
    """Logits for each chunk fed in turn (multi-token concat path and the
    single-token in-place path both get exercised)."""
    out = []
    for chunk in chunks:
        logits = m(mx.array([chunk]), cache=prompt_cache)
        mx.eval(logits)
        out.append(logits)
    return out


def serve(layers, length: int):
    """What the store's ``fetch`` returns at ``length``: KV rows
    ``[max(0, length - window) or 0, length)`` and states as they are."""
    out = []
    for l in layers:
        if isinstance(l, StateLayer):
            out.append(l)
            continue
        lo = max(0, length - l.window) if l.window else 0
        assert l.start <= lo and l.stop >= length, (l.start, l.stop, lo, length)
        a, b = lo - l.start, length - l.start
        out.append(KVLayer(take_rows(l.keys, a, b), take_rows(l.values, a, b), lo, l.window))
    return out


def assert_same_logits(a: list[mx.array], b: list[mx.array]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert mx.array_equal(x, y).item(), float(mx.abs(x - y).max())


def assert_same_state(a, b):
    """Two caches hold the same ``state`` (arrays bit for bit, counters equal):
    the same thing to continue from, as ``save_prompt_cache`` would write it."""
    sa, sb = a.state, b.state
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        if isinstance(x, mx.array):
            assert x.shape == y.shape and mx.array_equal(x, y).item()
        else:
            assert x == y


def assert_close_logits(a: list[mx.array], b: list[mx.array]):
    for x, y in zip(a, b):
        diff = float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max())
        assert diff <= CLOSE["atol"], diff


NEXT = [toks(5, seed=7)] + [[t] for t in toks(6, seed=8)] + [toks(3, seed=9)]


# ---------------------------------------------------------------------------
# KVCache
# ---------------------------------------------------------------------------


def test_kvcache_roundtrip_exact_and_engine_like():
    m = model("llama")
    n = 300  # crosses one 256 step, not a multiple of it
    orig = prefill(m, toks(n))
    assert orig[0].keys.shape[2] == 512  # the engine over-allocates

    layers = cache_to_layers(orig)
    assert cache_offset(orig) == n
    assert [type(l) for l in layers] == [KVLayer, KVLayer]
    for l in layers:
        assert l.start == 0 and l.window is None and l.stop == n
        assert l.keys.shape == (1, 2, n, 64) and l.values.shape == (1, 2, n, 64)

    new = layers_to_cache(serve(layers, n), m, length=n)
    for a, b in zip(orig, new):
        assert type(b) is C.KVCache
        assert b.offset == a.offset and b.size() == a.size() == n
        assert [x.shape for x in b.state[:2]] == [x.shape for x in a.state[:2]]
        assert b.nbytes == a.nbytes
        assert b.is_trimmable() and not b.empty()
        ka, va = keys_and_values(a)
        kb, vb = keys_and_values(b)
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()
        for N in (1, 4):
            kw = dict(return_array=False, window_size=None)
            assert str(a.make_mask(N, **kw)) == str(b.make_mask(N, **kw))
        kw = dict(return_array=True, window_size=None)
        assert mx.array_equal(a.make_mask(4, **kw), b.make_mask(4, **kw)).item()

    assert_same_logits(feed(m, orig, NEXT), feed(m, new, NEXT))

    # trim + append (the in-place write into the spare rows)
    C.trim_prompt_cache(orig, 4)
    C.trim_prompt_cache(new, 4)
    assert_same_logits(feed(m, orig, [[5], [6, 7]]), feed(m, new, [[5], [6, 7]]))


def test_prefix_of_longer_prefill():
    """A fetch at L < stored length rebuilds what a prefill of L tokens gives."""
    m = model("llama")
    t = toks(300)
    layers = cache_to_layers(prefill(m, t))
    ref = prefill(m, t[:200])
    new = layers_to_cache(serve(layers, 200), m, length=200)
    assert new[0].offset == 200 and new[0].keys.shape[2] == 256
    assert_close_logits(feed(m, ref, NEXT), feed(m, new, NEXT))


def test_trimmed_rows_do_not_pin_the_engine_buffer():
    """Emitted arrays are compact copies, not views of the 256-step buffer
    (a view keeps the whole allocation alive in the store)."""
    c = C.KVCache()
    big = mx.ones((1, 1, 10, 4096), mx.float32)  # 1 head: the slice is row-contiguous
    c.update_and_fetch(big, big)
    mx.eval(c.keys, c.values)
    (l,) = cache_to_layers([c])
    assert l.keys.shape == (1, 1, 10, 4096)
    mx.clear_cache()
    before = mx.get_active_memory()
    del c
    mx.clear_cache()
    freed = before - mx.get_active_memory()
    assert freed >= 2 * 256 * 4096 * 4  # both engine buffers are gone


def test_no_aliasing_either_way():
    m = model("llama")
    orig = prefill(m, toks(40))
    layers = cache_to_layers(orig)
    snap = np.array(layers[0].keys)
    feed(m, orig, [[1], [2]])  # in-place writes into the engine buffer
    C.trim_prompt_cache(orig, 10)
    feed(m, orig, [[3]])
    assert np.array_equal(np.array(layers[0].keys), snap)

    served = serve(layers, 40)
    new = layers_to_cache(served, m, length=40)
    C.trim_prompt_cache(new, 10)
    feed(m, new, [[3], [4]])
    assert np.array_equal(np.array(served[0].keys), snap)


def test_layers_are_evaluated_for_other_threads():
    """The store reads layers on its own thread; mlx streams are thread-local,
    so a lazy array from the engine thread would fail there."""
    m = model("gemma3_text")
    orig = prefill(m, toks(50))
    feed(m, orig, [[1], [2]])  # rotated ring: temporal order is a lazy concat
    layers = cache_to_layers(orig)
    errors = []

    def consume():
        try:
            for l in layers:
                np.array(l.keys)
                np.array(l.values)
        except Exception as e:  # pragma: no cover - the failure we guard against
            errors.append(repr(e))

    th = threading.Thread(target=consume)
    th.start()
    th.join()
    assert errors == []


def test_batch_merge_of_rebuilt_cache():
    m = model("llama")
    ta, tb = toks(300, seed=2), toks(37, seed=3)
    orig = [prefill(m, ta), prefill(m, tb)]
    new = [
        layers_to_cache(serve(cache_to_layers(orig[0]), 300), m, length=300),
        layers_to_cache(serve(cache_to_layers(orig[1]), 37), m, length=37),
    ]
    merged_o = [C.KVCache.merge([orig[0][i], orig[1][i]]) for i in range(2)]
    merged_n = [C.KVCache.merge([new[0][i], new[1][i]]) for i in range(2)]
    for a, b in zip(merged_o, merged_n):
        assert type(b) is C.BatchKVCache
        assert_same_state(a, b)
    step = mx.array([[11], [12]])
    lo, ln = m(step, cache=merged_o), m(step, cache=merged_n)
    assert mx.array_equal(lo, ln).item()
    # ... and one sequence extracted back out of the batch is storable again.
    back = cache_to_layers([c.extract(1) for c in merged_n])
    assert back[0].stop == 38


def test_batch_size_must_be_one():
    c = C.KVCache()
    x = mx.zeros((2, 1, 3, 64))
    c.update_and_fetch(x, x)
    with pytest.raises(ValueError, match="batch size 2"):
        cache_to_layers([c])
    with pytest.raises(ValueError, match="extract"):
        cache_to_layers([C.BatchKVCache([0, 1])])
    a = C.ArraysCache(2, left_padding=[1])
    a[0] = mx.zeros((1, 3, 8))
    with pytest.raises(ValueError, match="left_padding"):
        cache_to_layers([a])


def test_layer_count_and_kind_mismatch():
    m = model("llama")
    layers = cache_to_layers(prefill(m, toks(10)))
    with pytest.raises(ValueError):
        layers_to_cache(layers[:1], m, length=10)
    with pytest.raises(ValueError):
        layers_to_cache(layers + layers[:1], m, length=10)
    with pytest.raises(ValueError, match="StateLayer"):
        layers_to_cache([StateLayer([None, None])] + layers[1:], m, length=10)
    with pytest.raises(ValueError, match="need tokens"):
        layers_to_cache(layers, m, length=11)


# ---------------------------------------------------------------------------
# QuantizedKVCache
# ---------------------------------------------------------------------------


def _engine_quantize(prompt_cache, bits, group=64):
    """What mlx-lm's maybe_quantize_kv_cache does (quantized_kv_start=0)."""
    return [c.to_quantized(group_size=group, bits=bits) for c in prompt_cache]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_roundtrip_exact(bits):
    m = model("llama")
    n = 300
    orig = _engine_quantize(prefill(m, toks(n)), bits)
    layers = cache_to_layers(orig)
    for l in layers:
        assert isinstance(l.keys, Quantized) and isinstance(l.values, Quantized)
        assert (l.keys.bits, l.keys.group_size) == (bits, 64)
        assert l.keys.shape == (1, 2, n, 64)  # logical shape
        assert all(a.shape[2] == n for a in l.keys.arrays())  # trimmed
    new = layers_to_cache(serve(layers, n), m, length=n, kv_bits=bits, kv_group_size=64)
    for a, b in zip(orig, new):
        assert type(b) is C.QuantizedKVCache
        assert (b.bits, b.group_size, b.offset) == (bits, 64, n)
        assert b.nbytes == a.nbytes
        for x, y in zip(keys_and_values(a), keys_and_values(b)):
            assert all(mx.array_equal(p, q).item() for p, q in zip(x, y))
    assert_same_logits(feed(m, orig, NEXT), feed(m, new, NEXT))


def test_quantized_from_dense_and_between_settings():
    m = model("llama")
    n = 130
    dense = prefill(m, toks(n))
    layers = cache_to_layers(dense)

    # dense entries + kv_bits: bit-identical to the engine quantizing itself
    eng = _engine_quantize(dense, 4)
    new = layers_to_cache(serve(layers, n), m, length=n, kv_bits=4)
    for a, b in zip(eng, new):
        for x, y in zip(keys_and_values(a), keys_and_values(b)):
            assert all(mx.array_equal(p, q).item() for p, q in zip(x, y))
    assert_same_logits(feed(m, eng, NEXT), feed(m, new, NEXT))

    # 8-bit entries asked as 4-bit / group 32: requantized from the dequantized values
    q8 = cache_to_layers(_engine_quantize(prefill(m, toks(n)), 8))
    new = layers_to_cache(serve(q8, n), m, length=n, kv_bits=4, kv_group_size=32)
    want = mx.quantize(q8[0].keys.dequantize(), group_size=32, bits=4)
    got = keys_and_values(new[0])[0]
    assert (new[0].bits, new[0].group_size) == (4, 32)
    assert all(mx.array_equal(p, q).item() for p, q in zip(want, got))

    # quantized entries, dense engine: dequantized into a KVCache
    new = layers_to_cache(serve(q8, n), m, length=n)
    assert type(new[0]) is C.KVCache
    assert mx.array_equal(keys_and_values(new[0])[0], q8[0].keys.dequantize()).item()

    # quantized_kv_start: below it the engine still holds a dense cache
    new = layers_to_cache(serve(layers, n), m, length=n, kv_bits=8, quantized_kv_start=5000)
    assert type(new[0]) is C.KVCache


# ---------------------------------------------------------------------------
# RotatingKVCache (sliding window)
# ---------------------------------------------------------------------------


def test_rotating_one_shot_prefill_longer_than_window():
    m = model("gemma3_text")
    n = 100  # window 32: wraps
    orig = prefill(m, toks(n))
    layers = cache_to_layers(orig)
    assert cache_layout(orig) == ["Rotating(max_size=32,keep=0)", "KV"] * 2
    rot = layers[0]
    # A one-shot prefill keeps every row: all of them go to the store.
    assert (rot.start, rot.stop, rot.window) == (0, n, 32)

    served = serve(layers, n)
    assert served[0].keys.shape[2] == 32
    new = layers_to_cache(served, m, length=n)
    for a, b in zip(orig, new):
        assert type(a) is type(b) and b.offset == a.offset and b.size() == a.size()
    assert new[0].keys.shape[2] == 32  # the window, not the engine's 100 rows
    for N in (1, 5):
        for ws in (None, 32):
            ma = orig[0].make_mask(N, window_size=ws)
            mb = new[0].make_mask(N, window_size=ws)
            if isinstance(ma, mx.array):
                assert mx.array_equal(ma, mb).item()
            else:
                assert ma == mb
    # the engine's first decode step trims its buffer to the window: from
    # there on both rings hold the same rows at the same write position
    assert_same_logits(feed(m, orig, [[3]]), feed(m, new, [[3]]))
    assert_same_state(orig[0], new[0])
    chunks = NEXT + [[t] for t in toks(40, seed=11)] + [toks(4, seed=12)]
    assert_same_logits(feed(m, orig, chunks), feed(m, new, chunks))


def test_rotating_shorter_than_window_grows_in_place():
    m = model("gemma3_text")
    orig = prefill(m, toks(20))
    new = layers_to_cache(serve(cache_to_layers(orig), 20), m, length=20)
    assert_same_state(orig[0], new[0])
    chunks = [[t] for t in toks(30, seed=5)] + [toks(6, seed=6)] + [[1], [2]]
    assert_same_logits(feed(m, orig, chunks), feed(m, new, chunks))


def test_rotating_prefix_of_longer_prefill():
    m = model("gemma3_text")
    t = toks(100)
    layers = cache_to_layers(prefill(m, t))

    # prefix of a longer prefill: served from rows [38, 70)
    ref = prefill(m, t[:70])
    new = layers_to_cache(serve(layers, 70), m, length=70)
    assert_close_logits(feed(m, ref, NEXT), feed(m, new, NEXT))



def test_rotating_ring_rotated_while_decoding():
    """A ring that rotated while decoding is stored in temporal order. The
    rebuilt ring holds the same rows in another order, so the single-token
    path reduces over them in another order: float32 model, tolerance 1e-4
    (observed ~1e-5; a wrong or missing row shows up as ~1e-1)."""
    m = model("gemma3_text_f32")
    orig = prefill(m, toks(40))
    feed(m, orig, [[x] for x in toks(13, seed=4)])
    layers = cache_to_layers(orig)
    assert orig[0].keys.shape[2] == 32  # a full ring written past its end:
    assert not mx.array_equal(layers[0].keys, orig[0].keys).item()  # buffer order is not temporal order
    assert (layers[0].start, layers[0].stop) == (53 - 32, 53)
    new = layers_to_cache(serve(layers, 53), m, length=53)
    chunks = [[x] for x in toks(40, seed=5)] + NEXT
    for x, y in zip(feed(m, orig, chunks), feed(m, new, chunks)):
        assert float(mx.abs(x - y).max()) < 1e-4


def test_rotating_batch_merge():
    m = model("gemma3_text")
    orig = [prefill(m, toks(100, seed=2)), prefill(m, toks(20, seed=3))]
    new = [
        layers_to_cache(serve(cache_to_layers(orig[0]), 100), m, length=100),
        layers_to_cache(serve(cache_to_layers(orig[1]), 20), m, length=20),
    ]
    mo = [type(orig[0][i]).merge([orig[0][i], orig[1][i]]) for i in range(4)]
    mn = [type(new[0][i]).merge([new[0][i], new[1][i]]) for i in range(4)]
    assert type(mn[0]) is C.BatchRotatingKVCache
    step = mx.array([[11], [12]])
    assert mx.array_equal(m(step, cache=mo), m(step, cache=mn)).item()


def test_kv_bits_with_sliding_window_model():
    """kv_bits quantizes only the full-attention slots; mlx-lm has no quantized
    rotating cache (its maybe_quantize_kv_cache even raises on one), so
    quantized entries for a rotating slot are dequantized."""
    m = model("gemma3_text")
    n = 100
    orig = prefill(m, toks(n))
    layers = cache_to_layers(orig)
    eng = [c.to_quantized(group_size=64, bits=8) if type(c) is C.KVCache else c for c in orig]
    new = layers_to_cache(serve(layers, n), m, length=n, kv_bits=8)
    assert [type(c) for c in new] == [C.RotatingKVCache, C.QuantizedKVCache] * 2
    assert_same_logits(feed(m, eng, NEXT), feed(m, new, NEXT))

    q = [
        KVLayer(*(Quantized(*mx.quantize(t, group_size=64, bits=8), 8, 64)
                  for t in (l.keys, l.values)), l.start, l.window)
        for l in layers
    ]
    new = layers_to_cache(serve(q, n), m, length=n)
    assert [type(c) for c in new] == [C.RotatingKVCache, C.KVCache] * 2
    want = serve(q, n)[0].keys.dequantize()
    assert mx.array_equal(new[0].keys, want).item()


def test_rotating_keep_sink_tokens():
    """make_prompt_cache(model, max_kv_size) -> RotatingKVCache(keep=4)
    (only for models without their own make_cache(): llama has one and
    silently ignores max_kv_size)."""
    m = model("qwen3")
    orig = prefill(m, toks(100), C.make_prompt_cache(m, max_kv_size=64))
    assert cache_layout(orig) == ["Rotating(max_size=64,keep=4)"] * 2
    layers = cache_to_layers(orig)
    # Nothing evicted yet (one-shot prefill keeps all rows): full-attention entry.
    assert (layers[0].start, layers[0].stop, layers[0].window) == (0, 100, None)
    new = layers_to_cache(serve(layers, 100), m, length=100, max_kv_size=64)
    assert_same_state(orig[0], new[0])  # keep 4, max_size 64, all 100 rows, write position
    chunks = NEXT + [[t] for t in toks(70, seed=13)] + [toks(3, seed=14)]
    assert_same_logits(feed(m, orig, chunks), feed(m, new, chunks))

    # After eviction only the tail after the sink is contiguous: stored with
    # start > keep; alone it cannot be restored (the sink rows are missing).
    tail = cache_to_layers(orig)
    off = orig[0].offset
    # The last chunk (3 tokens) went through the concat path, which leaves
    # keep + (max_size - 1 - keep) + 3 = 66 rows: a tail of 62 after the sink.
    assert orig[0].keys.shape[2] == 66
    assert (tail[0].start, tail[0].stop, tail[0].window) == (off - 62, off, None)
    assert mx.array_equal(tail[0].keys, orig[0].keys[..., 4:, :]).item()
    with pytest.raises(ValueError, match="need tokens"):
        layers_to_cache(tail, m, length=off, max_kv_size=64)


# ---------------------------------------------------------------------------
# ArraysCache, CacheList, ChunkedKVCache
# ---------------------------------------------------------------------------


def test_arrays_cache_hybrid_exact():
    m = model("qwen3_next")
    n = 77
    orig = prefill(m, toks(n))
    layers = cache_to_layers(orig)
    assert cache_layout(m) == ["Arrays(2)", "KV"] * 2
    assert [type(l) for l in layers] == [StateLayer, KVLayer] * 2
    assert all(a is not None for a in layers[0].arrays) and len(layers[0].arrays) == 2
    new = layers_to_cache(serve(layers, n), m, length=n)
    assert type(new[0]) is C.ArraysCache and new[0].left_padding is None
    assert_same_logits(feed(m, orig, NEXT), feed(m, new, NEXT))


def test_cache_list_exact():
    m = model("baichuan_m1")
    n = 50  # window 32 on layer 0
    orig = prefill(m, toks(n))
    assert cache_layout(orig) == [
        "CacheList(Arrays(2),Rotating(max_size=32,keep=0))",
        "CacheList(Arrays(2),KV)",
    ]
    layers = cache_to_layers(orig)
    assert [type(l) for l in layers] == [StateLayer, KVLayer] * 2
    new = layers_to_cache(serve(layers, n), m, length=n)
    assert [type(c) for c in new] == [C.CacheList] * 2
    assert [type(s) for s in new[0].caches] == [C.ArraysCache, C.RotatingKVCache]
    assert new[0].caches[1].keys.shape[2] == 32
    chunks = NEXT + [[t] for t in toks(30, seed=15)]
    assert_same_logits(feed(m, orig, chunks), feed(m, new, chunks))


def recomputed(m, tokens: list[int], chunks: list[list[int]]) -> list[mx.array]:
    """Logits of each chunk from a fresh one-shot prefill of everything before
    and including it: the reference no cache state can have drifted from."""
    out, seen = [], list(tokens)
    for chunk in chunks:
        seen += chunk
        logits = m(mx.array([seen]), cache=C.make_prompt_cache(m))[:, -len(chunk):]
        mx.eval(logits)
        out.append(logits)
    return out


@pytest.mark.skipif(MLX_LM < (0, 32), reason="mlx-lm 0.31's own ChunkedKVCache breaks once its buffer has grown "
                    "(maybe_trim_front trims by buffer size, not by rows held): fixed in 0.32")
def test_chunked_kv_cache():
    m = model("llama4")
    n = 40  # chunk 16
    prompt = toks(n)
    orig = prefill(m, prompt)
    assert cache_layout(orig) == ["Chunked(chunk_size=16)"] * 3 + ["KV"]
    layers = cache_to_layers(orig)
    assert (layers[0].start, layers[0].stop, layers[0].window) == (0, n, 16)
    new = layers_to_cache(serve(layers, n), m, length=n)
    assert (new[0].start_position, new[0].offset) == (24, 40)
    chunks = NEXT + [[t] for t in toks(20, seed=16)]
    # The rebuilt cache holds only the last 16 rows, the engine's all 40 until
    # its next maybe_trim_front: same math, other buffer length.
    assert_close_logits(recomputed(m, prompt, chunks), feed(m, new, chunks))
    assert_close_logits(feed(m, orig, chunks), recomputed(m, prompt, chunks))
    # after decoding, the engine's own trimmed state converts as well
    layers = cache_to_layers(orig)
    off = orig[0].offset
    assert layers[0].stop == off and layers[0].start == orig[0].start_position


# ---------------------------------------------------------------------------
# layout + fingerprint
# ---------------------------------------------------------------------------


def test_layout_model_vs_cache():
    m = model("llama")
    dense = prefill(m, toks(10))
    assert cache_layout(m) == cache_layout(dense) == ["KV", "KV"]
    # quantizing the KV cache is a serving option, not a different model
    assert layout_signature(_engine_quantize(dense, 8)) == layout_signature(m)
    assert layout_signature(C.make_prompt_cache(m, max_kv_size=64)) == layout_signature(m)
    q = model("qwen3")  # no make_cache(): max_kv_size gives keep=4 rotating caches
    assert layout_signature(C.make_prompt_cache(q, max_kv_size=64)) != layout_signature(q)


def _write_model(path: Path, m, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(m.parameters())))
    return path


_FP_SCRIPT = (
    "import sys; sys.path.insert(0, sys.argv[1]);"
    "from kvstore.adapters.mlx_lm import model_fingerprint;"
    "print(model_fingerprint(sys.argv[2], extra='x'))"
)


def test_model_fingerprint(tmp_path):
    m = model("llama")
    cfg = CONFIGS["llama"][1]
    p = _write_model(tmp_path / "m", m, cfg)
    fp = model_fingerprint(p, extra="x")
    assert re.fullmatch(r"[0-9a-f]{32}", fp)  # an xxh3-128 hex digest

    # stable across processes (no salted hash())
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run(
        [sys.executable, "-c", _FP_SCRIPT, str(ROOT), str(p)],
        capture_output=True, text=True, check=True, env=env,
    )
    assert out.stdout.strip() == fp

    # the path/name is not part of it, JSON formatting and key order are not either
    q = _write_model(tmp_path / "other-name", m, dict(reversed(list(cfg.items()))))
    assert model_fingerprint(q, extra="x") == fp

    # a config value changes it
    (q / "config.json").write_text(json.dumps(dict(cfg, rope_theta=20000.0)))
    assert model_fingerprint(q, extra="x") != fp
    (q / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(q, extra="x") == fp

    # one weight byte changes it, wherever it is: in the header, the data's start, middle or end
    w = q / "model.safetensors"
    orig = w.read_bytes()
    header_end = 8 + int.from_bytes(orig[:8], "little")
    for pos in (20, header_end + 3, len(orig) // 2, len(orig) - 3):
        data = bytearray(orig)
        data[pos] ^= 0x01
        w.write_bytes(bytes(data))
        assert model_fingerprint(q, extra="x") != fp, pos
    w.write_bytes(orig)
    assert model_fingerprint(q, extra="x") == fp
    # ... and so does the file size
    w.write_bytes(orig + b" ")
    assert model_fingerprint(q, extra="x") != fp

    # tokenizer, layout and extra are part of it
    r = _write_model(tmp_path / "r", m, cfg)
    (r / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"b": 0}}}))
    assert model_fingerprint(r, extra="x") != fp
    assert model_fingerprint(p, m, extra="x") != fp
    assert model_fingerprint(p, m, extra="x") == model_fingerprint(
        p, C.make_prompt_cache(m), extra="x"
    )
    assert model_fingerprint(p, m, extra="x") != model_fingerprint(
        p, [C.RotatingKVCache(64, keep=4) for _ in range(2)], extra="x"
    )
    assert model_fingerprint(p, extra="y") != fp
