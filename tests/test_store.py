"""PrefixStore's public API, rule by rule: what ``put`` stores, what
``fetch`` and ``contains`` serve (prefixes to the token, recurrent state,
sliding windows, quantized KV, image tokens), isolation between models,
layout and token errors, ``clear``, settings and budgets refused, and
concurrent callers.

Where blocks are kept (RAM admission, eviction, promotion) is
tests/test_placement.py; the background writer tests/test_writer.py; the
LMDB tier tests/test_lmdb_tier.py; what survives a reopen
tests/test_persistence.py; opening a path tests/test_open.py."""

from __future__ import annotations

import gc
import threading

import mlx.core as mx
import numpy as np
import pytest

from kvstore.blocks.codec import Codec
from kvstore.errors import ConfigError, KVStoreError, LayoutError
from kvstore.blocks.layers import KVLayer, Quantized, StateLayer
from kvstore.config import GB, StoreConfig
from kvstore.store import PrefixStore

from ._helpers import BLOCK_BYTES, BS, M, assert_hit_is, dq, kv_layers, put, rows, same, state_at, toks

# --------------------------------------------------------------- dedup, hits


def test_put_stores_only_blocks_not_stored_yet(store):
    """A prompt sharing a prefix with stored ones adds only its new blocks; put
    returns how many; putting the same prompt again adds nothing."""
    a = toks(20)  # blocks [0,8) [8,16) and a tail [16,20)
    assert put(store, a) == 3
    store.flush()
    assert store.stats()["ram_blocks"] == 3
    b = a[:16] + toks(10, 5000)  # shares two full blocks, then [16,24) and a tail [24,26)
    assert put(store, b) == 2
    store.flush()
    ram = store.stats()["ram_bytes"]
    assert store.stats()["ram_blocks"] == 5 and len(store) == 5
    assert put(store, a) == 0 and put(store, b) == 0
    store.flush()
    assert store.stats()["ram_bytes"] == ram and store.stats()["puts"] == 4
    assert_hit_is(store.fetch(M, a), a, 20)
    assert_hit_is(store.fetch(M, b), b, 26)


def test_short_prompt_is_served_from_its_tail_block(store):
    """A prompt shorter than a block is kept as a tail block and served exactly,
    also inside a longer prompt and down to token granularity."""
    p = toks(5)
    assert put(store, p) == 1
    assert_hit_is(store.fetch(M, p), p, 5)
    assert_hit_is(store.fetch(M, p + [1, 2, 3, 4, 5, 6]), p + [1, 2, 3, 4, 5, 6], 5)
    assert_hit_is(store.fetch(M, p[:3]), p[:3], 3)
    assert_hit_is(store.fetch(M, p[:2] + [7, 7]), p[:2] + [7, 7], 2)
    assert not store.fetch(M, [7] + p)


def test_prompts_diverging_mid_block_hit_to_the_token(store):
    """The hit ends exactly where the prompt diverges, even inside a block,
    and carries the KV of the shared tokens."""
    a = toks(24)
    put(store, a)
    for shared in (1, 3, 8, 13, 16, 23):
        b = a[:shared] + toks(6, 9000)
        assert_hit_is(store.fetch(M, b), b, shared)
        assert store.contains(M, b) == shared


def test_limit_caps_the_hit(store):
    """``limit`` bounds the hit (``len - 1`` leaves one token for the engine to process)."""
    a = toks(24)
    put(store, a)
    assert_hit_is(store.fetch(M, a, limit=len(a) - 1), a, 23)
    assert_hit_is(store.fetch(M, a, limit=16), a, 16)
    assert_hit_is(store.fetch(M, a, limit=100), a, 24)
    assert not store.fetch(M, a, limit=0)


def test_empty_prompt_is_a_miss(store):
    """Nothing is stored for, or served to, an empty prompt."""
    assert store.put(M, [], [KVLayer(mx.zeros((1, 1, 0, 32)), mx.zeros((1, 1, 0, 32)))]) == 0
    assert not store.fetch(M, [])
    put(store, toks(8))
    assert not store.fetch(M, [])


# ------------------------------------------------------------ recurrent state


def state_layers(p):
    return [kv_layers(p, n_layers=1)[0], state_at(p)]


def assert_state_hit(hit, p, length):
    assert hit.length == length
    if not length:
        return
    kv, state = hit.layers
    (k, v), = [(l.keys, l.values) for l in kv_layers(p[:length], n_layers=1)]
    assert same(kv.keys, k) and same(kv.values, v) and kv.start == 0
    assert isinstance(state, StateLayer)
    want = state_at(p[:length])
    assert same(state.arrays[0], want.arrays[0]) and state.arrays[1] is None


def test_state_model_hits_only_where_a_snapshot_was_taken(store):
    """A recurrent state is valid at one position: a model with state layers
    is served only at lengths where a snapshot is stored."""
    p = toks(30)
    store.put(M, p[:24], state_layers(p[:24]))  # one snapshot, at 24
    assert_state_hit(store.fetch(M, p), p, 24)
    assert_state_hit(store.fetch(M, p[:24]), p, 24)
    for n in (23, 20, 16, 9, 8):
        assert_state_hit(store.fetch(M, p[:n]), p, 0)


def test_state_snapshots_at_every_block_boundary(store):
    """Puts at block boundaries (as the generation helper does) give a
    snapshot at each, and every one of them is servable."""
    p = toks(30)
    for n in (8, 16, 24):
        store.put(M, p[:n], state_layers(p[:n]))
    for n, want in ((30, 24), (24, 24), (23, 16), (16, 16), (15, 8), (8, 8), (7, 0)):
        assert_state_hit(store.fetch(M, p[:n]), p, want)
        assert store.contains(M, p[:n]) == want


@pytest.mark.parametrize("on_ssd", [False, True])
def test_adding_a_snapshot_keeps_longer_prefixes(store, ssd, on_ssd):
    """Putting a shorter prefix later (adding a snapshot to a block stored
    without one) does not lose what was stored beyond it."""
    s = ssd() if on_ssd else store
    p = toks(24)
    s.put(M, p, state_layers(p))
    assert s.put(M, p[:16], state_layers(p[:16])) == 1  # re-encodes block [8,16) with its snapshot
    s.flush()
    assert_state_hit(s.fetch(M, p), p, 24)
    assert_state_hit(s.fetch(M, p[:20]), p, 16)
    if on_ssd:
        s.close()
        s = ssd()
        assert_state_hit(s.fetch(M, p[:20]), p, 16)
        assert_state_hit(s.fetch(M, p), p, 24)


# -------------------------------------------------------------- sliding window


def window_layers(p, window, start=0):
    """A full-attention layer and a sliding-window layer holding rows [start, len(p))."""
    full, win = kv_layers(p)
    return [full, KVLayer(win.keys[..., start:, :], win.values[..., start:, :], start, window)]


def assert_window_hit(hit, p, length, window):
    assert hit.length == length
    full, win = hit.layers
    (fk, fv), (wk, wv) = [(l.keys, l.values) for l in kv_layers(p[:length])]
    assert full.start == 0 and same(full.keys, fk) and same(full.values, fv)
    lo = max(0, length - window)
    assert win.window == window and win.start == lo and win.stop == length
    assert same(win.keys, wk[..., lo:, :]) and same(win.values, wv[..., lo:, :])


def test_sliding_window_layer_restores_only_its_window(store):
    """A sliding-window layer comes back as rows [L - window, L) only."""
    p = toks(32)
    store.put(M, p, window_layers(p, window=12))
    assert_window_hit(store.fetch(M, p), p, 32, 12)
    assert_window_hit(store.fetch(M, p[:27]), p, 27, 12)
    assert_window_hit(store.fetch(M, p[:5]), p, 5, 12)


def test_sliding_window_layer_given_only_its_window(store):
    """An engine that hands in only the window's rows (start > 0) is served
    where those rows cover [L - window, L), and never at a length that needs
    rows it did not give."""
    p = toks(32)
    store.put(M, p, window_layers(p, window=16, start=16))
    assert_window_hit(store.fetch(M, p), p, 32, 16)
    assert_window_hit(store.fetch(M, p + [1, 2, 3]), p, 32, 16)
    for n in (31, 24, 16, 8):  # would need rows before 16
        assert not store.fetch(M, p[:n])


def test_full_attention_layer_missing_rows_is_not_stored(store):
    """Rows a full-attention layer lacks can't be made up: nothing before them is stored."""
    p = toks(16)
    full, other = kv_layers(p)
    short = KVLayer(other.keys[..., 8:, :], other.values[..., 8:, :], 8)
    assert store.put(M, p, [full, short]) == 0
    assert not store.fetch(M, p)


def test_sliding_window_rows_starting_mid_block(store, ssd):
    """A window whose rows start inside a block (what an engine holds after
    decoding past its window) is served where the window is covered, from RAM
    and from disk after a restart, and never where it reaches missing rows."""
    p = toks(30)  # block size 8: rows [18, 30) start inside block [16, 24)
    on_disk = ssd()
    for s in (store, on_disk):
        s.put(M, p, window_layers(p, window=12, start=18))
        s.flush()
        assert_window_hit(s.fetch(M, p), p, 30, 12)
        assert s.fetch(M, p[:29]).length == 0  # its window would start at 17
    on_disk.close()
    reopened = ssd()
    assert_window_hit(reopened.fetch(M, p), p, 30, 12)
    assert reopened.fetch(M, p[:29]).length == 0


# ------------------------------------------------------------------ quantized


def test_quantized_fetch_returns_quantized_arrays(store):
    """``quantized=(bits, group_size)`` hands back ``Quantized`` KV equal to
    quantizing the stored rows with those settings."""
    p = toks(20)
    put(store, p)
    hit = store.fetch(M, p, quantized=(8, 32))
    assert hit.length == 20
    for layer, ref in zip(hit.layers, kv_layers(p)):
        for got, x in ((layer.keys, ref.keys), (layer.values, ref.values)):
            assert isinstance(got, Quantized) and (got.bits, got.group_size) == (8, 32)
            assert got.shape == x.shape
            assert all(same(a, b) for a, b in zip(got.arrays(), mx.quantize(x, group_size=32, bits=8)))


def test_kv_bits_store_quantizes_per_key_and_value():
    """``kv_bits=(8, 4)`` keeps keys at 8 and values at 4 bits; fetch dequantizes."""
    s = PrefixStore(budget_gb=1, block_size=BS, kv_bits=(8, 4), kv_group_size=32)
    try:
        p = toks(20)
        put(s, p)
        hit = s.fetch(M, p)
        for layer, ref in zip(hit.layers, kv_layers(p)):
            values = Codec.from_bits((8, 4), 32).compress_values(ref.values)  # rotated at 4 bits by default
            assert values.rotation is not None
            assert same(layer.keys, dq(ref.keys, 8, 32)) and same(layer.values, values.dequantize())
        q = s.fetch(M, p, quantized=(8, 32)).layers[0]
        assert q.keys.bits == 8 and q.values.bits == 8
    finally:
        s.close()


# ------------------------------------------------------------------ isolation


def test_models_do_not_share_blocks(store):
    """Identical prompts of different models never hit each other's KV."""
    p = toks(20)
    put(store, p)
    assert not store.fetch("another-model", p)
    assert not store.fetch(M.encode() + b"\0", p)
    other = [KVLayer(l.keys + 1, l.values + 1) for l in kv_layers(p)]
    assert store.put("another-model", p, other) == 3
    assert_hit_is(store.fetch(M, p), p, 20)
    assert same(store.fetch("another-model", p).layers[0].keys, other[0].keys)


def test_namespaces_do_not_share_blocks(ssd):
    """Stores of different namespaces on one SSD path never see each other's
    blocks; the same namespace does."""
    p = toks(20)
    s = ssd(namespace="tenant-a")
    put(s, p)
    s.close()
    for ns in ("tenant-b", None, ""):
        s = ssd(namespace=ns)
        assert not s.fetch(M, p) and s.contains(M, p) == 0
        s.close()
    s = ssd(namespace="tenant-a")
    assert_hit_is(s.fetch(M, p), p, 20)


def test_blocks_of_other_shapes_under_one_model_key_are_a_miss_not_an_error(store):
    """A model key reused for a model of another shape must not raise into the engine."""
    a = toks(8)
    store.put(M, a, kv_layers(a, heads=1))
    b = a + toks(8, start=5000)
    wide = kv_layers(b, heads=2)
    store.put(M, b, wide)  # block 2 stored with 2 heads under block 1 with 1 head
    store.flush()
    assert store.fetch(M, b).length == 0  # never an exception, never mixed rows


# --------------------------------------------------------------------- layout


@pytest.mark.parametrize("make,match", [
    (lambda p: [KVLayer(rows(p, 0, heads=2), rows(p, 1, heads=1))], r"layer 0: keys .* and values .* must share"),
    (lambda p: [kv_layers(p)[0], KVLayer(rows(p[:-1], 0), rows(p[:-1], 1))], r"layer 1: rows cover tokens \[0, 7\) but the prompt has 8"),
    (lambda p: [KVLayer(rows(p, 0)[0], rows(p, 1)[0])], r"layer 0: keys/values must be \[batch, heads, tokens, dim\]"),
    (lambda p: [KVLayer(mx.concatenate([rows(p, 0)] * 2), mx.concatenate([rows(p, 1)] * 2))], r"batch \(1\)"),
    (lambda p: [kv_layers(p)[0], "not a layer"], r"layer 1: expected KVLayer or StateLayer, got str"),
    (lambda p: [], r"non-empty list"),
    (lambda p: [KVLayer(rows(p, 0), rows(p, 1), start=3)], r"rows cover tokens \[3, 11\)"),
])
def test_put_of_mismatched_arrays_raises_layout_error(store, make, match):
    """Arrays that do not fit together or the tokens raise LayoutError (a
    ValueError) naming the layer and the shapes; nothing is stored."""
    p = toks(8)
    with pytest.raises(LayoutError, match=match):
        store.put(M, p, make(p))
    assert len(store) == 0
    with pytest.raises(ValueError):
        store.put(M, p, make(p))


def test_bad_tokens_raise_value_error(store):
    """Token ids must be a flat sequence of signed 64-bit integers."""
    for bad in ([2**63] * 8, [-(2**63) - 1] * 8, [1.5] * 8, [[1] * 8]):
        with pytest.raises(ValueError):
            store.put(M, bad, kv_layers(toks(8)))


# mlx-lm's server keys every patch token of an image by -1 - int(sha256(url).hexdigest()[:15], 16)
IMAGE = -1 - int("9f86d081884c7d6", 16)


def test_image_prompts_with_64_bit_ids_are_stored_and_share_their_text(ssd):
    """A prompt whose image tokens carry a ~60-bit negative id is stored and
    served like any other, from RAM and after a restart from SSD; a text-only
    prompt sharing the text before the image hits that text, also where the
    two diverge inside the block holding the image (compared against the
    block's 64-bit tokens in its index record once RAM is empty)."""
    text = toks(13)  # block [0, 8) is text; block [8, 16) is text, then the image
    image = text + [IMAGE] * 6 + toks(7, 4000)
    other = text + toks(5, 9000)
    s = ssd()
    assert put(s, image) == 4
    s.flush()
    assert_hit_is(s.fetch(M, image), image, 26)
    assert_hit_is(s.fetch(M, other), other, 13)
    s.close()
    s = ssd()
    assert_hit_is(s.fetch(M, other), other, 13)
    assert_hit_is(s.fetch(M, image), image, 26)


def test_text_blocks_have_one_key_in_text_and_image_prompts(store):
    """Blocks before an image hash as they do in a text-only prompt: a stored
    text prompt serves an image prompt that starts with it, and the other way round."""
    text = toks(16)
    put(store, text)
    image = text + [IMAGE] * 4 + [5]
    assert_hit_is(store.fetch(M, image), image, 16)
    put(store, image)
    again = text + [IMAGE] * 4 + [6]
    assert_hit_is(store.fetch(M, again), again, 20)


# --------------------------------------------------------- clear, settings


def test_clear_drops_everything(ssd):
    """``clear`` empties RAM and disk: nothing is served, now or after reopening."""
    p = toks(20)
    s = ssd()
    put(s, p)
    s.clear()
    assert not s.fetch(M, p) and len(s) == 0 and s.nbytes == 0
    s.close()
    s = ssd()
    assert not s.fetch(M, p) and len(s) == 0


@pytest.mark.parametrize("kwargs", [dict(budget_gb=float("nan")), dict(budget_gb=float("inf")), dict(budget_gb=-1),
                                    dict(disk_budget_gb=float("nan")), dict(block_size=0), dict(block_size=2.5),
                                    dict(kv_bits=7), dict(kv_group_size=48)])
def test_settings_out_of_range_raise_config_error(tmp_path, kwargs):
    """Every setting the store cannot use is a ConfigError (a KVStoreError and
    a ValueError) naming the setting; nothing is created on disk."""
    path = tmp_path / "store"
    with pytest.raises(ConfigError) as e:
        PrefixStore(ssd_path=path, **kwargs)
    assert isinstance(e.value, KVStoreError) and isinstance(e.value, ValueError)
    assert next(iter(kwargs)).replace("kv_", "") in str(e.value).replace("kv_", "")
    assert not path.exists()


def test_a_path_or_an_unknown_setting_is_a_config_error_naming_what_to_pass(tmp_path):
    """``PrefixStore("/some/dir")`` (settings are keywords) and an unknown
    keyword, alone or beside a config, say what the store takes; nothing is
    created on disk."""
    path = tmp_path / "store"
    with pytest.raises(ConfigError, match="ssd_path="):
        PrefixStore(path)
    with pytest.raises(ConfigError, match="path"):
        PrefixStore(path=path)
    with pytest.raises(ConfigError, match="budget_gib"):
        PrefixStore(StoreConfig(ssd_path=path), budget_gib=1)
    assert not path.exists()


def test_set_budget_refuses_nan(store):
    with pytest.raises(ConfigError, match="budget_gb"):
        store.set_budget(float("nan"))


# ------------------------------------------------------------ python objects


def test_blocks_held_in_ram_share_one_layer_table(ssd):
    """Every whole block of a model is laid out alike: the tiers keep one
    table of its arrays for them all, not a few objects per array per block,
    which Python's garbage collector would walk, holding the engine's thread
    (the GIL), at every full collection."""
    s = ssd()
    first, second = toks(40 * BS), toks(40 * BS, start=10**6)
    s.put(M, first, kv_layers(first, n_layers=8))
    s.flush()
    gc.collect()
    before = len(gc.get_objects())
    s.put(M, second, kv_layers(second, n_layers=8))
    s.flush()
    gc.collect()
    assert s.stats()["ram_blocks"] == 80
    assert (len(gc.get_objects()) - before) / 40 < 15  # a table each: 8 layers x 2 tensors x 4 objects and more


# --------------------------------------------------------------- concurrency


def test_concurrent_puts_and_fetches_never_serve_wrong_kv():
    """Threads putting and fetching overlapping prompts under a small budget
    only ever see correct KV."""
    s = PrefixStore(budget_gb=6 * BLOCK_BYTES / GB, block_size=BS)
    base = toks(12)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                p = base[: rng.integers(1, 12)] + [int(x) for x in rng.integers(0, 4, size=rng.integers(0, 14))]
                if rng.random() < 0.5:
                    put(s, p)
                else:
                    hit = s.fetch(M, p)
                    assert_hit_is(hit, p, hit.length)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()
    assert not errors, errors[0]
