"""Why a prompt missed: every token a fetch does not serve has a reason.

``Hit.not_served`` maps reason -> tokens, and for every fetch the tokens
served plus those not served are the prompt's tokens; ``stats()`` sums them
(``tokens_not_served``). Each test below makes one reason happen on purpose,
through the public API, with real arrays, a real LMDB file and a real
redis-server; each fetch's reasons are also checked in the store's Prometheus series, as ``kvstore serve``'s
``/metrics`` serves them (over HTTP: tests/test_server.py; through ``kvstore explain``: tests/test_explain.py and
tests/test_cli_explain.py)."""

from __future__ import annotations

import numpy as np

from prometheus_client import CollectorRegistry

from kvstore.adapters.metrics import StoreCollector
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
from kvstore.config import GB
from kvstore.hit import REASONS
from kvstore.store import PrefixStore

from ._helpers import BLOCK_BYTES, BS, M, assert_hit_is, block_by_block, flip_a_byte, kv_layers, put, state_at, toks


def not_served_series(store) -> dict[str, float]:
    """``kvstore_tokens_not_served_total`` by reason, as ``GET /metrics`` serves it (the server's collector)."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    return {r: registry.get_sample_value("kvstore_tokens_not_served_total", {"reason": r}) for r in REASONS}


def why(store, tokens, model=M, **kw) -> dict[str, int]:
    """The fetch's reasons, checked to add up with what it served to the prompt's tokens, and to be what the
    store's Prometheus series count for it."""
    before = not_served_series(store)
    hit = store.fetch(model, tokens, **kw)
    assert set(hit.not_served) <= set(REASONS) and all(v > 0 for v in hit.not_served.values())
    assert hit.length + sum(hit.not_served.values()) == len(tokens), (hit.length, hit.not_served)
    after = not_served_series(store)
    assert {r: after[r] - before[r] for r in REASONS} == {r: hit.not_served.get(r, 0) for r in REASONS}
    return hit.not_served


def test_a_prompt_never_stored_is_new_and_its_last_part_block_is_tail(store):
    assert why(store, toks(30)) == {"new": 24, "tail": 6}
    assert why(store, toks(5)) == {"tail": 5}


def test_the_part_past_a_stored_prefix_is_tail_where_the_prompt_departs_inside_a_block(store):
    """Stored: 20 tokens (two whole blocks and 4 of a third). A prompt departing after 12 tokens is served
    12; the rest of that block is ``tail``, the next whole block ``new``, the last part block ``tail``."""
    p = toks(20)
    put(store, p)
    store.flush()
    assert why(store, p + toks(10, 7000)) == {"tail": 10}  # [20, 24) and [24, 30): no whole block unstored
    assert why(store, p[:12] + toks(18, 5000)) == {"tail": 4 + 6, "new": 8}


def test_tokens_past_the_limit_are_limit(store):
    p = toks(24)
    put(store, p)
    store.flush()
    assert why(store, p, limit=23) == {"limit": 1}
    assert why(store, p, limit=0) == {"limit": 24}


def test_stored_tokens_the_cost_model_declines_are_declined(store):
    p = toks(24)
    put(store, p)
    store.flush()
    store.fetch_policy = "never"
    assert why(store, p + toks(3, 9000)) == {"declined": 24, "tail": 3}
    assert store.stats()["tokens_skipped_cost"] == 24


def test_blocks_a_ram_only_store_evicted_past_its_budget_are_evicted():
    """Three blocks fit: a second prompt of three blocks evicts the first; the first then misses as
    ``evicted``, block by block, and a never-stored one as ``new``."""
    with PrefixStore(budget_gb=3.5 * BLOCK_BYTES / GB, block_size=BS) as s:
        a, b = toks(24), toks(24, start=5000)
        put(s, a)
        s.flush()
        put(s, b)
        s.flush()
        assert why(s, a) == {"evicted": 24}
        assert why(s, toks(24, start=9000)) == {"new": 24}
        assert_hit_is(s.fetch(M, b), b, 24)


def test_blocks_evicted_from_the_disk_tier_are_evicted(ssd):
    s = ssd(budget_gb=2 * BLOCK_BYTES / GB)
    a, b = toks(32), toks(32, start=5000)
    put(s, a)
    s.flush()
    put(s, b)
    s.flush()
    assert s.trim_disk(0) > 0  # every disk copy leaves: what RAM does not hold is gone
    reasons = why(s, a)
    assert set(reasons) == {"evicted"} and reasons["evicted"] == 32


def test_the_same_tokens_under_another_model_key_are_other_model(store):
    p = toks(30)
    put(store, p)
    store.flush()
    assert why(store, p, model="another-model") == {"other_model": 24, "tail": 6}
    assert why(store, toks(30, 5000), model="another-model") == {"new": 24, "tail": 6}  # (no model holds these)


def test_a_hybrid_model_without_a_snapshot_at_the_boundary_is_no_snapshot(store):
    """A recurrent state is valid at the one position it was taken: stored at 24, a prompt ending at 20
    matches 20 stored tokens and can be served none of them."""
    p = toks(30)
    store.put(M, p[:24], [kv_layers(p[:24], n_layers=1)[0], state_at(p[:24])])
    store.flush()
    assert why(store, p[:20]) == {"no_snapshot": 20}
    assert why(store, p) == {"tail": 6}  # served 24


def test_a_put_the_writer_skipped_in_a_burst_is_skipped(ssd, monkeypatch):
    block_by_block(monkeypatch)
    s = ssd(max_pending_bytes=1)
    a, b = toks(24), toks(24, start=5000)
    with s.pause_writer():  # the writer is held: the second put is past the bound
        put(s, a)
        assert put(s, b) == 0
    s.flush()
    assert why(s, b) == {"skipped": 24}
    assert why(s, a) == {}


def test_a_block_failing_its_checks_is_corrupt_on_that_fetch_and_after(ssd, tmp_path):
    """A flipped byte in block 2: the fetch serves the two blocks before it; the bad block and the one
    after it (served only through it) are ``corrupt``, then and on the next fetch."""
    p = toks(32)
    s = ssd()
    put(s, p)
    s.close()
    flip_a_byte(tmp_path / "store", KeyChain(root_key(M), as_tokens(p), BS).key(2))
    s = ssd()
    assert why(s, p) == {"corrupt": 16}
    assert why(s, p) == {"corrupt": 16}
    assert s.stats()["corrupt_blocks"] == 1


def test_stats_sum_the_reasons_and_every_reason_is_listed(store):
    p = toks(30)
    put(store, p[:16])
    store.flush()
    why(store, p)
    why(store, toks(12, 4000))
    why(store, p, limit=10)
    st = store.stats()
    assert set(st["tokens_not_served"]) == set(REASONS)
    served = st["tokens_ram"] + st["tokens_ssd"] + st["tokens_remote"]
    assert served + sum(st["tokens_not_served"].values()) == st["tokens_requested"] == 30 + 12 + 30
    assert st["tokens_not_served"]["limit"] == 20 and st["tokens_not_served"]["new"] == 8 + 8


# ------------------------------------------------------------------ the remote tier


RBS = 64  # the remote tests' block size


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 5000, size=n).tolist()


def _host(tmp_path, name: str, url: str, **kw) -> PrefixStore:
    return PrefixStore(**dict(dict(budget_gb=0.25, ssd_path=tmp_path / name, block_size=RBS, remote=url), **kw))


def test_blocks_on_a_remote_that_is_down_are_unavailable(redis_server, tmp_path):
    """Host a stored the prompt on the remote; host b has none of it locally and the server is stopped:
    its whole blocks are ``unavailable`` (not ``new``), its last part block ``tail``."""
    p = _prompt(200, seed=1)
    with _host(tmp_path, "a", redis_server.url) as a:
        a.put(M, p, kv_layers(p))
        a.flush()
    with _host(tmp_path, "b", redis_server.url) as b:
        redis_server.kill()
        assert why(b, p) == {"unavailable": 192, "tail": 8}


def test_the_same_tokens_on_the_remote_in_blocks_of_another_size_are_other_model(redis_server, tmp_path):
    """Host b keeps blocks of 128 tokens, the remote holds the model in blocks of 64: b is served the remote's
    first block as a part of its own first one (64 tokens, the rest of that block ``tail``); its next whole
    block is held on the remote in blocks of another size: ``other_model``."""
    p, q = _prompt(300, seed=2), _prompt(300, seed=3)
    with _host(tmp_path, "a", redis_server.url) as a, _host(tmp_path, "b", redis_server.url, block_size=2 * RBS) as b:
        for t in (p, q):
            a.put(M, t, kv_layers(t))
        a.flush()
        b.put(M, p, kv_layers(p))  # b registers the model: the remote holds it in blocks of another size
        b.flush()
        assert b.stats()["remote_block_size_mismatch"] == 1
        assert why(b, q) == {"tail": 64 + 44, "other_model": 128}
