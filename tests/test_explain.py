"""``PrefixStore.explain``: a dry run of the fetch for one prompt. Each reason made to happen on purpose, on
real stores (LMDB files, a real Redis server): the explanation's served tokens and reasons are what the fetch
right after it serves and puts in ``Hit.not_served``, block by block they add up to the prompt, and the dry
run loads nothing, indexes nothing and counts nothing."""

import pytest

from kvstore import PrefixStore
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key

from ._helpers import BS, BLOCK_BYTES, M, flip_a_byte, kv_layers, put, state_at, toks

OTHER = "other-model"


def agrees(store, tokens, model=M, limit=None):
    """The explanation of ``tokens``, checked against itself and against the fetch made right after it."""
    e = store.explain(model, tokens, limit=limit)
    assert e.served + sum(e.not_served.values()) == len(tokens)
    per: dict[str, int] = {}
    for b in e.blocks:
        assert b.served + sum(b.not_served.values()) == b.end - b.start
        for r, k in b.not_served.items():
            per[r] = per.get(r, 0) + k
    assert sum(b.served for b in e.blocks) == e.served and per == e.not_served
    assert [b.start for b in e.blocks] == list(range(0, len(tokens), store.block_size))
    hit = store.fetch(model, tokens, limit=limit)
    assert (hit.length, hit.not_served) == (e.served, e.not_served)
    return e


def wheres(e) -> list[str]:
    return [b.where for b in e.blocks]


def test_new_tail_and_a_limit(tmp_path):
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS) as store:
        e = agrees(store, toks(30))  # an empty store
        assert e.served == 0 and e.not_served == {"new": 24, "tail": 6} and set(wheres(e)) == {"nowhere"}
        assert e.verdict.servable == 0 and e.tiers == ["ram", "disk"] and e.model == M
        p = toks(40)
        put(store, p)
        store.flush()
        q = p[:28] + [7] * 20  # departs inside block 3
        e = agrees(store, q)
        assert e.served == 28 and e.not_served == {"tail": 4, "new": 16}
        assert wheres(e) == ["ram"] * 4 + ["nowhere"] * 2
        assert e.blocks[3].served == 4 and e.blocks[3].not_served == {"tail": 4}
        e = agrees(store, p, limit=20)
        assert e.served == 20 and e.not_served == {"limit": 20} and e.limit == 20


def test_other_model_names_the_model_that_holds_the_tokens(tmp_path):
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS) as store:
        store.register_model(OTHER, {"name": "tiny-llama"})
        p = toks(36)
        store.put(OTHER, p, kv_layers(p))
        put(store, toks(16, 7000))  # this model holds other prompts
        store.flush()
        e = agrees(store, p)
        assert e.not_served == {"other_model": 32, "tail": 4} and all(b.where == "nowhere" for b in e.blocks)
        assert [b.held_by for b in e.blocks] == ["tiny-llama"] * 4 + [None]


def test_declined_shows_the_cost_models_numbers(tmp_path):
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS) as store:
        p = toks(64)
        put(store, p)
        store.flush()
        assert store.fetch(M, p).length == 64  # a rate measured; prefill not yet: served
        for n in (100, 1000, 4000, 8000):  # an engine that prefills 1e9 tokens/s
            store.observe_prefill(M, 0, n, n * 1e-9)
        e = agrees(store, p)
        v = e.verdict
        assert e.served == 0 and e.not_served == {"declined": 64} and v.servable == 64 and v.length == 0
        assert "recomputing" in v.reason and v.recompute_s == pytest.approx(64e-9, rel=0.5)
        assert all(b.loads_from == "ram" for b in e.blocks)
        store.fetch_policy = "always"
        e = agrees(store, p)
        assert e.served == 64 and e.verdict.reason == "policy always"


def test_evicted_from_the_disk_tier(tmp_path):
    with PrefixStore(budget_gb=0, ssd_path=tmp_path / "s", block_size=BS) as store:
        old, new = toks(32), toks(32, start=5000)
        put(store, old)
        store.flush()
        put(store, new)
        store.flush()
        assert store.trim_disk(4 * BLOCK_BYTES + 4096) > 0  # the least recently used: the old prompt's, leaves first
        e = agrees(store, old)
        assert e.not_served.get("evicted", 0) >= BS and e.served + e.not_served["evicted"] == 32
        assert wheres(e)[: e.served // BS] == ["disk"] * (e.served // BS)
        assert all(b.where == "nowhere" for b in e.blocks if "evicted" in b.not_served)


def test_no_snapshot_of_a_hybrid_model(tmp_path):
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS) as store:
        p = toks(64)
        store.put(M, p, [*kv_layers(p), state_at(p)])  # the state only at token 64
        store.flush()
        e = agrees(store, p[:40] + [9] * 20)
        assert e.not_served == {"no_snapshot": 40, "new": 16, "tail": 4} and e.verdict.servable == 0
        assert wheres(e)[:5] == ["ram"] * 5


def test_a_corrupt_block_reads_as_on_disk_until_a_fetch_finds_it(tmp_path):
    """explain reads no payload: a block flipped on disk shows on disk and planned; the fetch that reads it
    finds it corrupt (and serves the blocks before it), and from then on this process explains it so."""
    path, p = tmp_path / "s", toks(40)
    with PrefixStore(ssd_path=path, block_size=BS) as store:
        put(store, p)
    key = KeyChain(root_key(M), as_tokens(p), BS).key(2)
    flip_a_byte(path, key)
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=BS) as store:
        before = store.explain(M, p)
        assert before.served == 40 and wheres(before) == ["disk"] * 5
        hit = store.fetch(M, p)
        assert hit.length == 16 and hit.not_served == {"corrupt": 24}
        e = agrees(store, p)
        assert e.served == 16 and e.not_served == {"corrupt": 24}
        assert wheres(e) == ["disk"] * 2 + ["nowhere"] * 3


def test_a_put_still_being_stored(tmp_path):
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS) as store, store.pause_writer():
        p = toks(24)
        put(store, p)
        e = agrees(store, p)
        assert e.served == 24 and wheres(e) == ["queued"] * 3 and "still being stored" in e.verdict.reason


def test_explain_changes_nothing(tmp_path):
    with PrefixStore(budget_gb=BLOCK_BYTES * 6 / 2**30, ssd_path=tmp_path / "s", block_size=BS) as store:
        for start in (1000, 3000):
            put(store, toks(40, start))
        store.flush()
        store.fetch(M, toks(40))
        store.flush()  # (the fetch's disk blocks promoted to RAM, in the background, before the first look)
        state = lambda: (store.stats(), store.debug().ram_keys, len(store))  # noqa: E731
        was = state()
        for q in (toks(40), toks(40, 3000), toks(40)[:20] + [1] * 30, toks(64, 9000)):
            store.explain(M, q)
        assert state() == was


# ---------------------------------------------------------------------- remote


def test_remote_blocks_are_explained_from_their_records_and_not_indexed(tmp_path, redis_server):
    server, p = redis_server, toks(40)
    with PrefixStore(ssd_path=tmp_path / "a", block_size=BS, remote=server.url) as a:
        put(a, p)
        a.flush()
    with PrefixStore(ssd_path=tmp_path / "b", block_size=BS, remote=server.url) as b:
        e = b.explain(M, p[:36] + [5] * 10)  # four whole blocks and half of the fifth from the remote
        assert (e.served, wheres(e)) == (36, ["remote"] * 5 + ["nowhere"]) and e.tiers == ["ram", "disk", "remote"]
        counts = {k: v for k, v in b.stats().items() if k.startswith("remote_")}
        assert len(b) == 0 and counts["remote_lookups"] == 0  # nothing indexed, nothing counted
        agrees(b, p[:36] + [5] * 10)
        assert len(b) == 5  # the fetch indexed them
        assert wheres(agrees(b, p)) == ["ram"] * 5  # all local now
    with PrefixStore(ssd_path=tmp_path / "d", block_size=BS, remote=server.url) as d:
        put(d, p[:16])
        d.flush()
        assert wheres(agrees(d, p[:38])) == ["ram"] * 2 + ["remote"] * 3  # the local blocks, then the remote's
    with PrefixStore(ssd_path=tmp_path / "c", block_size=BS, remote=server.url) as c:
        server.kill()
        e = agrees(c, p)
        assert e.not_served == {"unavailable": 40}
