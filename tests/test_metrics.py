"""The store's Prometheus series (``GET /metrics`` on ``kvstore serve``; the
process test is tests/test_server.py::test_metrics_endpoint_counts_what_the_server_serves)."""

from prometheus_client import CollectorRegistry, generate_latest

from kvstore.adapters.metrics import BY_LABEL, COUNTERS, GAUGES, HISTOGRAMS, StoreCollector
from kvstore.flow.reasons import REASONS

from ._helpers import M, put, toks
from ._redis import free_port


def registry(store) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(StoreCollector(store))
    return r


def test_every_series_reads_a_stats_key_of_a_store_with_every_tier(ssd):
    """A misspelt key would drop its series silently (tiers a store lacks are left out)."""
    store = ssd(remote=f"redis://127.0.0.1:{free_port()}/0", remote_timeout=0.2)  # nothing listens there
    stats = store.stats()
    for _, _, key in COUNTERS + GAUGES:
        keys = key.values() if isinstance(key, dict) else key if isinstance(key, tuple) else [key]
        assert set(keys) <= set(stats), keys
    assert {key for _, _, key, _ in BY_LABEL} | {key for _, _, key in HISTOGRAMS} <= set(stats)
    names = {m.name for m in registry(store).collect()}
    assert len(names) == len(COUNTERS + GAUGES + BY_LABEL + HISTOGRAMS) and all(n.startswith("kvstore_") for n in names)


def test_each_store_has_its_own_series_read_at_scrape_time(ssd, store):
    disk = ssd()
    mine, other = registry(disk), registry(store)
    put(disk, toks(16))
    disk.flush()
    assert disk.fetch(M, toks(17)).length == 16
    value = mine.get_sample_value
    assert value("kvstore_puts_total") == 1 and value("kvstore_hits_total") == 1
    assert value("kvstore_tokens_served_total", {"tier": "ram"}) == 16
    assert value("kvstore_blocks", {"tier": "ssd"}) == value("kvstore_blocks", {"tier": "ram"}) == 2
    assert other.get_sample_value("kvstore_puts_total") == 0 and other.get_sample_value("kvstore_blocks",
                                                                                       {"tier": "ssd"}) is None
    store.close()
    assert b"kvstore_" not in generate_latest(other)  # a scrape racing shutdown: empty, not an error


def test_every_token_requested_is_served_by_a_tier_or_not_served_for_a_reason(ssd):
    """Issue 53: the tiers (device apart from ram) and the reasons add up to the tokens requested, each
    reason has a series (0 included), and the latency histograms count every fetch and put."""
    store = ssd()
    r = registry(store)
    value = r.get_sample_value
    assert {value("kvstore_tokens_not_served_total", {"reason": why}) for why in REASONS} == {0}
    put(store, toks(40))
    store.flush()
    prompts = [toks(40), toks(50), toks(40), toks(30, start=5000)]
    hits = [store.fetch(M, p, limit=20 if i == 2 else None) for i, p in enumerate(prompts)]
    assert [(h.length, h.not_served) for h in hits] == [(40, {}), (40, {"new": 8, "tail": 2}), (20, {"limit": 20}),
                                                         (0, {"new": 24, "tail": 6})]
    served = sum(value("kvstore_tokens_served_total", {"tier": t}) for t in ("device", "ram", "ssd"))
    why = {w: value("kvstore_tokens_not_served_total", {"reason": w}) for w in REASONS}
    assert served == 100 and why == dict(dict.fromkeys(REASONS, 0), new=32, tail=8, limit=20)
    assert served + sum(why.values()) == value("kvstore_tokens_requested_total") == sum(map(len, prompts))
    assert value("kvstore_fetch_seconds_count") == 4 == value("kvstore_fetch_seconds_bucket", {"le": "+Inf"})
    assert value("kvstore_put_seconds_count") == 1 == value("kvstore_puts_total")
    assert value("kvstore_fetch_seconds_sum") > 0 and value("kvstore_put_seconds_sum") > 0
    buckets = [value("kvstore_fetch_seconds_bucket", {"le": le}) for le in ("0.0001", "0.001", "0.01", "10.0")]
    assert buckets == sorted(buckets)  # cumulative
