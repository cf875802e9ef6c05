"""The store's Prometheus series (``GET /metrics`` on ``kvstore serve``; the
process test is tests/test_server.py::test_metrics_endpoint_counts_what_the_server_serves)."""

from prometheus_client import CollectorRegistry, generate_latest

from kvstore.adapters.metrics import COUNTERS, GAUGES, StoreCollector

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
    names = {m.name for m in registry(store).collect()}
    assert len(names) == len(COUNTERS + GAUGES) and all(n.startswith("kvstore_") for n in names)


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
