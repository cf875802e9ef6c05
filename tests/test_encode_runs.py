"""Runs of blocks encoded together (what the writer does on CUDA): each
layer's rows of consecutive blocks compressed at once and every array
copied once into the run's payloads. What a run stores is, byte for byte,
what encoding each of its blocks alone stores, for every codec and layout;
blocks a run cannot take (a prompt's last block with a state, a sliding
window's first rows, ids past int32, a block not wanted any more) are
encoded alone in between, in order, and what is served from runs is the
prompt's KV."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest

import kvstore.convert.encode as encoding
import kvstore.flow.writer as writer_mod
from kvstore.blocks.layers import KVLayer
from kvstore.store import PrefixStore

from ._helpers import BS, M, assert_hit_is, kv_layers, state_at, toks


def _job(monkeypatch, tokens, layers, **kw):
    """The writer's job of one put (its nodes, rows and codec), taken before the writer runs it."""
    s = PrefixStore(**dict(dict(budget_gb=1, block_size=BS), **kw))
    jobs, writer = [], s._writer
    register = writer.register
    monkeypatch.setattr(writer, "register", lambda job: jobs.append(job) or register(job))  # (register_put's)
    monkeypatch.setattr(writer, "submit", lambda pending: 0)  # (kept here, never run)
    s.put(M, tokens, layers)
    monkeypatch.undo()
    (job,) = jobs
    job.nodes = s._table.new_refs(job.ident)  # (what the writer takes when it runs the job)
    return s, job


def _bytes(s, job, together: bool, wanted=lambda n: True, compress_rows: int = 2048):
    """Each block's (start, key, bytes). Alone, every block's rows are compressed by themselves (as on
    CUDA), so what a run compresses at once is checked against that, not against the same arrays."""
    job.compressed.clear()
    rows = compress_rows if together else BS
    return [(n.start, n.key, bytes(held.buf)) for n, held, _ in encoding.encoded(job, s.codec, rows, wanted,
                                                                                    together)]


LAYOUTS = {
    "fp16": (dict(), lambda p: kv_layers(p, heads=2, dim=64)),
    "bf16": (dict(), lambda p: kv_layers(p, heads=2, dim=64, dtype=mx.bfloat16)),
    "q8": (dict(kv_bits=8), lambda p: kv_layers(p, heads=2, dim=64)),
    "q4 rotated, g32": (dict(kv_bits=4, kv_group_size=32), lambda p: kv_layers(p, heads=2, dim=64)),
    "K8/V4, dim 96": (dict(kv_bits=(8, 4), kv_group_size=32), lambda p: kv_layers(p, heads=3, dim=96)),
    # the engine's buffers, with room for more rows: the store is given views of their first rows
    "views of larger buffers": (dict(kv_bits=8), lambda p: [KVLayer(k[..., : len(p), :], v[..., : len(p), :]) for k, v in (
        (l.keys, l.values) for l in kv_layers(p + list(range(5)), heads=2, dim=64))]),
    # a sliding-window layer holding the last 2.5 blocks: the blocks before it hold its layer in part or not
    "window": (dict(kv_bits=8), lambda p: [kv_layers(p, heads=2, dim=64)[0], KVLayer(
        *(t[..., len(p) - 2 * BS - 4:, :] for t in (kv_layers(p, heads=2, dim=64)[1].keys,
                                                   kv_layers(p, heads=2, dim=64)[1].values)),
        start=len(p) - 2 * BS - 4, window=2 * BS + 4)]),
    "state at the end": (dict(kv_bits=4), lambda p: [*kv_layers(p, heads=2, dim=64), state_at(p)]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_stores_what_each_block_alone_stores(monkeypatch, layout):
    kw, make = LAYOUTS[layout]
    p = toks(7 * BS)
    s, job = _job(monkeypatch, p, make(p), **kw)
    try:
        alone = _bytes(s, job, together=False)
        assert [a[0] for a in alone] == [i * BS for i in range(7)]
        assert _bytes(s, job, together=True) == alone
        assert _bytes(s, job, together=True, compress_rows=3 * BS) == alone  # runs of 3, 3 and 1
    finally:
        s.close()


def test_ids_past_int32_and_unwanted_blocks_go_alone_in_order(monkeypatch):
    p = toks(8 * BS)
    p[3 * BS + 2] = 1 << 40  # block 3 stores its ids as int64
    s, job = _job(monkeypatch, p, kv_layers(p, heads=2, dim=64), kv_bits=8)
    try:
        skip = {job.nodes[5].key}
        wanted = lambda n: n.key not in skip  # noqa: E731
        alone = _bytes(s, job, together=False, wanted=wanted)
        assert [a[0] // BS for a in alone] == [0, 1, 2, 3, 4, 6, 7]
        assert _bytes(s, job, together=True, wanted=wanted) == alone
    finally:
        s.close()


def test_each_block_is_asked_for_once_after_the_blocks_before_its_run_are_handed_over(monkeypatch):
    """``wanted`` is asked once per block, just before its run is encoded:
    block by block, after the one before it went to the writer; in runs, as
    the run is formed (a block dropped meanwhile is refused by ``admit``)."""
    p = toks(6 * BS)
    s, job = _job(monkeypatch, p, kv_layers(p, heads=2, dim=64))
    try:
        for together, rows in ((False, BS), (True, 3 * BS)):
            events = []
            for n, _, _ in encoding.encoded(job, s.codec, rows,
                                            lambda n: events.append(f"asked {n.start // BS}") or True, together):
                events.append(f"got {n.start // BS}")
            if together:  # runs of 3: asked for as the run forms, handed over together
                assert events == [f"asked {i}" for i in (0, 1, 2)] + [f"got {i}" for i in (0, 1, 2)] + \
                    [f"asked {i}" for i in (3, 4, 5)] + [f"got {i}" for i in (3, 4, 5)]
            else:
                assert events == [e for i in range(6) for e in (f"asked {i}", f"got {i}")]
    finally:
        s.close()


def test_blocks_of_megabytes_come_out_alike(monkeypatch):
    """Blocks of 1 MiB and more take buffers of the store's reused pool."""
    p = toks(3 * 256)
    s, job = _job(monkeypatch, p, kv_layers(p, n_layers=4, heads=8, dim=128), block_size=256)
    try:
        job.compressed.clear()
        codec = s.codec
        alone = [bytes(h.buf) for _, h, _ in encoding.encoded(job, codec, 256, lambda n: True, False)]
        assert len(alone) == 3 and min(map(len, alone)) > 1 << 20
        assert [bytes(h.buf) for _, h, _ in encoding.encoded(job, codec, 2048, lambda n: True, True)] == alone
    finally:
        s.close()


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_store_writing_runs_serves_the_prompt(monkeypatch, tmp_path, kv_bits):
    monkeypatch.setattr(writer_mod, "encoded", partial(encoding.encoded, together=True))
    p = toks(9 * BS + 3)
    with PrefixStore(budget_gb=1, block_size=BS, kv_bits=kv_bits, ssd_path=tmp_path / "s") as s:
        assert s.put(M, p, kv_layers(p)) == 10  # a run of 9 and the last 3 tokens alone
        s.flush()
        assert_hit_is(s.fetch(M, p), p, len(p), kv_bits=kv_bits)
    with PrefixStore(budget_gb=0, block_size=BS, kv_bits=kv_bits, ssd_path=tmp_path / "s") as s:
        assert_hit_is(s.fetch(M, p), p, len(p), kv_bits=kv_bits)  # from disk: the checksums hold
