"""Handing an engine's cache to the store copies none of its KV on the
engine's thread, and nothing the engine writes afterwards reaches the store.

``store_cache`` (``generate``'s put) and the server adapters' snapshot (what
mlx-lm's server and vllm-mlx insert) take new array objects on the cache's
buffers (``KVLayer(rows=n)`` where a buffer holds spare rows); mlx never
writes in place into data another array shares, so they keep the values of
the moment. Memory is read through mlx's own counters: a copy of the KV
would show as that many bytes more.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from kvstore import PrefixStore
from kvstore.adapters.generate import store_cache
from kvstore.adapters.mlx_lm import cache_to_layers, snapshot

LAYERS, HEADS, DIM, ROWS = 4, 4, 64, 1000


def engine_cache() -> tuple[list, int]:
    """A prompt's cache after one generated token (buffers larger than the rows), and its KV bytes."""
    cache = []
    for i in range(LAYERS):
        c = C.KVCache()
        k = mx.random.normal((1, HEADS, ROWS, DIM), key=mx.random.key(i)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        c.update_and_fetch(k[:, :, :1], k[:, :, :1])
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache, LAYERS * 2 * HEADS * (ROWS + 1) * DIM * 2


def test_the_server_adapters_snapshot_copies_none_of_the_engines_kv():
    cache, kv = engine_cache()
    before = mx.get_active_memory()
    frozen, arrays = snapshot(cache)
    mx.async_eval(arrays)
    mx.eval(arrays)
    assert mx.get_active_memory() - before < kv // 100
    assert len(arrays) == 2 * LAYERS


def test_store_cache_copies_none_of_the_engines_kv(tmp_path):
    cache, kv = engine_cache()
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "s", block_size=256, fetch_policy="always") as store:
        with store.pause_writer():  # the writer's own allocations wait until the put is measured
            mx.eval(mx.zeros(1))
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            assert store_cache(store, "m", list(range(ROWS + 1)), cache) == 4  # ceil(1001 / 256) blocks
            assert mx.get_peak_memory() - before < kv // 4  # a copy of the KV would be kv bytes
        store.flush()
        hit = store.fetch("m", list(range(ROWS + 1)))
    assert hit.length == ROWS + 1
    assert np.array_equal(np.array(hit.layers[0].keys), np.array(cache[0].keys[:, :, : ROWS + 1]))


def test_what_the_engine_writes_after_a_snapshot_never_reaches_it():
    cache, _ = engine_cache()
    held = [np.array(c.keys[:, :, : c.offset]) for c in cache]
    frozen, arrays = snapshot(cache)
    mx.async_eval(arrays)
    for c in cache:  # the engine goes on: rows rewritten in place, the cache cut back and written again
        c.keys[:, :, :10] = mx.zeros((1, HEADS, 10, DIM), mx.float16)
        C.trim_prompt_cache([c], 500)
        c.update_and_fetch(mx.ones((1, HEADS, 3, DIM), mx.float16), mx.ones((1, HEADS, 3, DIM), mx.float16))
    mx.eval([c.state for c in cache])
    layers = cache_to_layers(frozen, copy=False)
    for want, layer in zip(held, layers):
        assert layer.stop == want.shape[2]
        assert np.array_equal(np.array(layer.keys[:, :, : layer.stop]), want)


def test_store_cache_stores_an_engines_quantized_cache_up_to_its_offset():
    """mlx-lm's ``QuantizedKVCache`` (data, scales and biases in buffers of
    256-row steps) goes to the store as the same views, up to its offset, and
    comes back as the engine held it."""
    cache = []
    for i in range(LAYERS):
        c = C.QuantizedKVCache(group_size=64, bits=8)
        k = mx.random.normal((1, HEADS, ROWS, DIM), key=mx.random.key(i)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        cache.append(c)
    mx.eval([c.state for c in cache])
    with PrefixStore(budget_gb=1, block_size=256, kv_bits=8, kv_group_size=64, fetch_policy="always") as store:
        assert store_cache(store, "m", list(range(ROWS)), cache) == 4
        store.flush()
        hit = store.fetch("m", list(range(ROWS)), quantized=(8, 64))
    assert hit.length == ROWS
    for c, layer in zip(cache, hit.layers):
        for got, engine in ((layer.keys, c.keys), (layer.values, c.values)):
            assert engine[0].shape[2] > ROWS  # the engine's buffers have spare rows
            for a, b in zip(got.arrays(), engine):
                assert np.array_equal(np.array(a), np.array(b[:, :, :ROWS]))


def test_a_snapshot_copies_a_recurrent_state_so_a_batch_view_does_not_keep_the_batch():
    """mlx-lm's batch extract gives a sequence's state as a view of the whole batch's arrays: the snapshot
    holds a copy of the sequence's rows (a state is small), not the batch."""
    mx.clear_cache()
    base = mx.get_active_memory()
    batch = mx.random.normal((8, 64, 1024))
    mx.eval(batch)
    c = C.ArraysCache(1)
    c[0] = batch[2:3]
    frozen, arrays = snapshot([c])
    mx.eval(arrays)
    (state,) = frozen[0].cache
    assert np.array_equal(np.array(state), np.array(batch[2:3]))
    del batch, c
    mx.clear_cache()
    assert mx.get_active_memory() - base < 8 * 64 * 1024 * 4 // 2  # the batch (2 MiB) is gone; the row (256 KiB) stays
