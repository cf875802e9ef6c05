"""What ``put`` is given is what is stored: the values of the moment of the
call, in dtypes the store keeps exactly, whatever the caller does after.

The writer thread encodes a put's blocks after ``put`` has returned. Each
test holds it (a task queued on it before the put waits on an event) while
the caller changes what it handed over, then lets it go.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvstore import LayoutError, PrefixStore
from kvstore.blocks.layers import KVLayer, StateLayer

from ._helpers import assert_hit_is, block_by_block, kv_layers, state_at

BS = 8
M = "test-model"


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture(params=["ram", "ssd"])
def store(request, tmp_path):
    kw = dict(ssd_path=tmp_path / "store", budget_gb=0) if request.param == "ssd" else {}
    s = PrefixStore(block_size=BS, **kw)
    yield s
    s.close()


def test_slice_assignment_after_put_does_not_change_what_is_stored(store):
    """``layer.keys[...] = 0`` (mlx's slice assignment, the way mlx-lm's
    KVCache writes into its buffers) right after ``put`` changes neither the
    stored nor the served KV."""
    p = toks(3 * BS)
    layers = kv_layers(p)
    with store.pause_writer():  # the writer stores nothing until the caller is done
        assert store.put(M, p, layers) == 3
        for l in layers:
            l.keys[...] = 0
            l.values[..., 2:, :] = 7
        mx.eval([a for l in layers for a in (l.keys, l.values)])
    store.flush()
    assert_hit_is(store.fetch(M, p), p, len(p))


def test_rebinding_a_layers_arrays_after_put_does_not_change_what_is_stored(store):
    p = toks(2 * BS)
    layers = kv_layers(p)
    with store.pause_writer():  # the writer stores nothing until the caller is done
        store.put(M, p, layers)
        for l in layers:
            l.keys, l.values = mx.zeros_like(l.keys), mx.zeros_like(l.values)
    store.flush()
    assert_hit_is(store.fetch(M, p), p, len(p))


def test_an_mlx_lm_cache_writing_its_next_tokens_after_put_does_not_change_what_is_stored(store):
    """mlx-lm's KVCache holds a buffer larger than its offset and writes the
    next step's rows into it in place; a put of its whole buffer is kept as it
    was at the call."""
    p = toks(2 * BS)
    want = kv_layers(p, n_layers=1)[0]
    cache = KVCache()
    cache.update_and_fetch(want.keys, want.values)  # a 256-row buffer holding the prompt's 16 rows
    k, v = cache.keys[..., : len(p), :], cache.values[..., : len(p), :]
    with store.pause_writer():  # the writer stores nothing until the caller is done
        store.put(M, p, [KVLayer(cache.keys[..., : len(p), :], cache.values[..., : len(p), :])])
        cache.trim(4)  # the engine rewinds and writes other rows over the prompt's last 4
        cache.update_and_fetch(mx.zeros_like(k[..., :4, :]), mx.zeros_like(v[..., :4, :]))
        mx.eval(cache.keys, cache.values)
    store.flush()
    hit = store.fetch(M, p)
    assert hit.length == len(p)
    assert mx.array_equal(hit.layers[0].keys, want.keys).item()
    assert mx.array_equal(hit.layers[0].values, want.values).item()


def test_an_engine_buffer_with_spare_rows_is_stored_up_to_rows(store):
    """``KVLayer(..., rows=n)``: arrays with room after the prompt's rows (an
    engine's buffer) are stored as given, up to row n. The spare rows (NaN
    here) are never read, and what the engine writes after the put, there or
    over the prompt's rows, is not stored."""
    p = toks(2 * BS + 3)
    bufs = [[mx.concatenate([t, mx.full((*t.shape[:2], 5, t.shape[3]), float("nan"), t.dtype)], axis=2)
             for t in (l.keys, l.values)] for l in kv_layers(p)]
    mx.eval(bufs)
    with store.pause_writer():  # the writer stores nothing until the caller is done
        assert store.put(M, p, [KVLayer(k, v, rows=len(p)) for k, v in bufs]) == 3
        for kv in bufs:
            for t in kv:
                t[..., len(p) :, :] = 1
                t[..., :4, :] = 0
        mx.eval(bufs)
    store.flush()
    assert_hit_is(store.fetch(M, p), p, len(p))


def test_quantized_kv_with_numpy_int_settings_is_stored_like_any_other():
    """``Quantized`` settings given as numpy ints (a caller's own arithmetic
    makes them) store, and do not stop later puts of the same layout from
    storing (equal layouts share one header table)."""
    from kvstore.blocks.layers import Quantized

    with PrefixStore(block_size=BS, kv_bits=4, kv_group_size=64) as s:
        for i, settings in enumerate([(np.int64(4), np.int64(64)), (4, 64)]):
            p = toks(2 * BS, start=1000 + 100 * i)
            k = mx.random.normal((1, 1, len(p), 64), key=mx.random.key(i)).astype(mx.float16)
            q = Quantized(*mx.quantize(k, group_size=64, bits=4), *settings)
            assert s.put(M, p, [KVLayer(q, q)]) == 2
            s.flush()
            hit = s.fetch(M, p, quantized=(4, 64))
            assert hit.length == len(p)
            assert np.array_equal(np.array(hit.layers[0].keys.data), np.array(q.data))


def test_a_state_snapshot_changed_after_put_is_stored_as_given(store):
    p = toks(BS)
    state = state_at(p)
    want = np.array(state.arrays[0])
    with store.pause_writer():  # the writer stores nothing until the caller is done
        store.put(M, p, [*kv_layers(p, n_layers=1), state])
        state.arrays[0][...] = -1
        mx.eval(state.arrays[0])
    store.flush()
    hit = store.fetch(M, p)
    assert hit.length == len(p) and np.array_equal(np.array(hit.layers[1].arrays[0]), want)


# ---------------------------------------------------------------- dtypes


def test_numpy_arrays_of_a_storable_dtype_are_stored_exactly(store):
    """A numpy float16 or float32 array is accepted, copied at put, and served
    back exactly (as an mlx array)."""
    for i, dtype in enumerate((np.float16, np.float32)):
        p = toks(2 * BS, start=5000 * (i + 1))
        want = kv_layers(p, dtype={np.float16: mx.float16, np.float32: mx.float32}[dtype])
        given = [KVLayer(np.array(l.keys), np.array(l.values)) for l in want]
        assert store.put(M, p, given) == 2
        given[0].keys[...] = 0  # numpy writes in place: the store copied at put
        store.flush()
        hit = store.fetch(M, p)
        assert hit.length == len(p)
        for got, w in zip(hit.layers, want):
            assert got.keys.dtype == w.keys.dtype
            assert mx.array_equal(got.keys, w.keys).item() and mx.array_equal(got.values, w.values).item()


@pytest.mark.parametrize("make,says", [
    (lambda l: KVLayer(l.keys.astype(mx.int32), l.values.astype(mx.int32)), "int32 cannot be stored"),
    (lambda l: KVLayer(np.array(l.keys).astype(np.float64), np.array(l.values)), "numpy array of float64"),
    (lambda l: KVLayer(np.array(l.keys).astype(np.int16), np.array(l.values)), "numpy array of int16"),
    (lambda l: KVLayer(l.keys.astype(mx.float64, stream=mx.cpu) if hasattr(mx, "float64")  # (no GPU float64)
                       else l.keys.astype(mx.int16), l.values), "cannot be stored"),
    (lambda l: KVLayer(l.keys.tolist(), l.values), "expected an mlx array, got list"),
    (lambda l: StateLayer([np.zeros(3, np.float64)]), "numpy array of float64"),
    (lambda l: StateLayer("state"), "StateLayer.arrays must be a list"),
    (lambda l: KVLayer(l.keys, l.values, start="0"), "start must be an int"),
])
def test_arrays_the_store_cannot_keep_exactly_are_refused_at_put(store, make, says):
    """KV of a dtype the store cannot keep (ints, float64, non-arrays) is a
    LayoutError at ``put``, not a write dropped later or a block refused at
    every fetch; nothing is stored."""
    p = toks(BS)
    with pytest.raises(LayoutError, match=says):
        store.put(M, p, [make(kv_layers(p, n_layers=1)[0])])
    store.flush()
    assert len(store) == 0 and not store.fetch(M, p)


def test_a_put_keeps_the_kv_it_was_given_when_the_engine_writes_its_buffer_after(ssd, monkeypatch):
    """The writer serializes straight from the engine's buffers, after put
    has returned; an engine that writes into those buffers meanwhile (mlx-lm
    fills its cache in place) does not change what is stored."""
    import kvstore.convert.encode as encoding

    p = toks(3 * BS)
    layers = kv_layers(p)
    engine = [[l.keys, l.values] for l in layers]  # the engine's buffers, 1 spare row per layer
    engine = [[mx.concatenate([t, mx.zeros_like(t[..., :1, :])], axis=2) for t in kv] for kv in engine]
    given = [KVLayer(k[..., : len(p), :], v[..., : len(p), :]) for k, v in engine]
    mx.eval([t for kv in engine for t in kv] + [t for l in given for t in (l.keys, l.values)])
    wrote = threading.Event()
    real = encoding.encode

    def encode(*a):
        assert wrote.wait(10)
        return real(*a)

    monkeypatch.setattr(encoding, "encode", encode)
    block_by_block(monkeypatch)
    s = ssd(budget_gb=0)
    s.put(M, p, given)
    for kv in engine:  # the engine overwrites rows of the prompt (a trim and a new suffix)
        for t in kv:
            t[..., 2:, :] = mx.full(t[..., 2:, :].shape, 7.0, t.dtype)
        mx.eval(kv)
    wrote.set()
    s.flush()
    assert_hit_is(s.fetch(M, p), p, len(p))
