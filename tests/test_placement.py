"""Placement: which blocks RAM holds. Blocks are admitted to RAM within its
budget (none with a budget of 0, every block then on disk); eviction takes
leaves before the prefixes they hang from and the least recently used
first, so the longest prefix that fits stays servable; a lower budget
evicts at once; blocks read from disk are promoted to RAM, within its
budget, and hits say which tier served them."""

from __future__ import annotations

from kvstore.config import GB

from ._helpers import BLOCK_BYTES, M, assert_hit_is, put, toks

# ------------------------------------------------------------ RAM eviction


def test_ram_eviction_keeps_the_prefix_that_fits(store):
    """RAM only, a prompt larger than the budget: eviction takes leaves first,
    so the longest prefix that fits stays servable (not nothing)."""
    store.set_budget(2.5 * BLOCK_BYTES / GB)
    p = toks(40)
    put(store, p)
    store.flush()
    assert store.stats()["ram_bytes"] <= store.stats()["ram_budget"]
    assert_hit_is(store.fetch(M, p), p, 16)


def test_ram_eviction_is_least_recently_used(store):
    """The prompt fetched most recently survives; the other one is evicted."""
    a, b = toks(16, 1000), toks(16, 2000)
    put(store, a)
    put(store, b)
    store.flush()
    assert store.fetch(M, a)
    store.set_budget(2.5 * BLOCK_BYTES / GB)
    assert_hit_is(store.fetch(M, a), a, 16)
    assert not store.fetch(M, b)


def test_shrinking_the_budget_evicts_at_once(store):
    """``set_budget`` below what is held evicts immediately; 0 holds nothing."""
    for i in range(4):
        put(store, toks(16, 1000 * i))
    store.flush()
    assert store.nbytes == 8 * BLOCK_BYTES
    store.set_budget(3 * BLOCK_BYTES / GB)
    assert store.nbytes <= 3 * BLOCK_BYTES
    store.set_budget(0)
    assert store.nbytes == 0 and store.stats()["ram_blocks"] == 0


# ---------------------------------------------------- RAM admission, promotion


def test_no_ram_budget_with_ssd_keeps_everything_on_disk(ssd):
    """With a RAM budget of 0 every block goes to SSD, none is lost, and a
    fetch right after put (writes still in flight) already serves it all."""
    s = ssd(budget_gb=0)
    p = toks(40)
    assert put(s, p) == 5
    assert_hit_is(s.fetch(M, p), p, 40)
    s.flush()
    st = s.stats()
    assert st["ram_bytes"] == 0 and st["ssd_blocks"] == 5
    s.close()
    s = ssd(budget_gb=0)
    assert_hit_is(s.fetch(M, p), p, 40)


def test_hits_report_which_tier_served_them(ssd):
    """``ram_tokens`` and ``ssd_tokens`` split the hit; blocks read from SSD are promoted to RAM."""
    a = toks(20)
    s = ssd()
    put(s, a)
    s.close()
    s = ssd()
    hit = s.fetch(M, a)
    assert (hit.ram_tokens, hit.ssd_tokens) == (0, 20)
    hit = s.fetch(M, a)
    assert (hit.ram_tokens, hit.ssd_tokens) == (20, 0)
    st = s.stats()
    assert st["hits"] == 2 and st["tokens_ssd"] == 20 and st["tokens_ram"] == 20


def test_blocks_read_from_ssd_respect_the_ram_budget(ssd):
    """Promoting blocks read from SSD never leaves RAM above its budget."""
    p = toks(40)
    s = ssd()
    put(s, p)
    s.close()
    s = ssd(budget_gb=2.5 * BLOCK_BYTES / GB)
    assert_hit_is(s.fetch(M, p), p, 40)
    s.flush()  # promotion runs on a thread of its own; flush waits for it
    st = s.stats()
    assert 0 < st["ram_bytes"] <= st["ram_budget"]
