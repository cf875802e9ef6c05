"""Prometheus metrics of a store: ``GET /metrics`` on ``kvstore serve``.

A collector reads ``PrefixStore.stats()`` at scrape time, so serving a
request costs nothing more; each server has a registry of its own (not
prometheus-client's global one), so several stores in one process do not mix.
The names are listed in docs/engines.md ("Metrics").
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvstore import PrefixStore
from kvstore.errors import StoreClosedError

# name (without "_total"), help, and the stats() key, or {tier: key} for a metric with a "tier" label
COUNTERS = (
    ("kvstore_requests", "Cache lookups (hits and misses).", ("hits", "misses")),
    ("kvstore_hits", "Lookups that served a cached prefix.", "hits"),
    ("kvstore_misses", "Lookups that served nothing.", "misses"),
    ("kvstore_tokens_requested", "Prompt tokens looked up.", "tokens_requested"),
    ("kvstore_tokens_served", "Prompt tokens served from the cache, by the tier they were read from (device: "
     "copies in GPU memory; ram excludes those, so the tiers add up to the tokens served).",
     {"device": "tokens_device", "ram": "tokens_ram", "ssd": "tokens_ssd", "remote": "tokens_remote"}),
    ("kvstore_tokens_declined", "Cached tokens not served: the cost model predicted recomputing faster.",
     "tokens_skipped_cost"),
    ("kvstore_puts", "Caches offered to the store.", "puts"),
    ("kvstore_puts_skipped", "Puts dropped whole: the writer's backlog was past its bound.", "puts_skipped"),
    ("kvstore_blocks_skipped", "Blocks of skipped puts.", "blocks_skipped"),
    ("kvstore_blocks_stored", "New blocks stored.", "blocks_stored"),
    ("kvstore_blocks_written", "Blocks written to the SSD tier.", "blocks_written"),
    ("kvstore_bytes_written", "Bytes of blocks written to the SSD tier.", "bytes_written"),
    ("kvstore_evicted_unadmitted", "Blocks dropped from RAM that were never written to the SSD tier "
     "(ssd_admit=reuse: not asked for again).", "evicted_unadmitted"),
    ("kvstore_evictions", "Blocks evicted, by tier.", {"ram": "evictions_ram", "ssd": "evictions_ssd"}),
    ("kvstore_corrupt_blocks", "Blocks that failed their checksum or did not decode (dropped, not served).",
     "corrupt_blocks"),
    ("kvstore_write_errors", "Failed writes to the SSD tier.", "write_errors"),
    ("kvstore_remote_errors", "Failed calls to the remote tier (refused connections, timeouts).", "remote_errors"),
    ("kvstore_remote_refused", "Remote values refused (checksum, key binding, shape).", "remote_bad"),
)
# name (without "_total"), help, the stats() key of a {label value: count} dict, and the label
BY_LABEL = (
    ("kvstore_tokens_not_served", "Prompt tokens not served, by reason (docs/engines.md, Metrics); served plus "
     "not served is kvstore_tokens_requested_total.", "tokens_not_served", "reason"),
)
# name, help, the stats() key of a histogram ({"buckets": [[le, cumulative count], ...], "sum", "count"})
HISTOGRAMS = (
    ("kvstore_fetch_seconds", "Seconds a fetch took on the engine's thread.", "fetch_seconds"),
    ("kvstore_put_seconds", "Seconds a put took on the engine's thread (the writer stores its blocks later).",
     "put_seconds"),
)
GAUGES = (
    ("kvstore_bytes", "Bytes held, by tier.", {"device": "device_bytes", "ram": "ram_bytes", "ssd": "ssd_bytes"}),
    ("kvstore_blocks", "Blocks held, by tier.", {"device": "device_blocks", "ram": "ram_blocks", "ssd": "ssd_blocks"}),
    ("kvstore_budget_bytes", "Byte budget, by tier.",
     {"device": "device_budget", "ram": "ram_budget", "ssd": "ssd_budget"}),
    ("kvstore_writer_backlog_bytes", "Bytes queued for the writer (encoding, SSD writes).", "pending_bytes"),
    ("kvstore_writer_backlog_jobs", "Puts queued for the writer.", "pending_jobs"),
    ("kvstore_remote_queue_bytes", "Bytes queued for the remote tier.", "remote_queue_bytes"),
)


def _families(kind: type, table: tuple, stats: dict) -> Iterator[Metric]:
    for name, doc, key in table:
        if isinstance(key, dict):
            m = kind(name, doc, labels=["tier"])
            for tier, k in key.items():
                if k in stats:  # tiers the store lacks (no SSD path, no remote) are left out
                    m.add_metric([tier], stats[k])
            yield m
        elif isinstance(key, tuple):
            yield kind(name, doc, value=sum(stats[k] for k in key))
        elif key in stats:
            yield kind(name, doc, value=stats[key])


def _labelled(stats: dict) -> Iterator[Metric]:
    for name, doc, key, label in BY_LABEL:
        if key in stats:
            m = CounterMetricFamily(name, doc, labels=[label])
            for value, k in stats[key].items():
                m.add_metric([value], k)
            yield m


def _histograms(stats: dict) -> Iterator[Metric]:
    for name, doc, key in HISTOGRAMS:
        if key in stats:
            h = stats[key]
            buckets = [(floatToGoString(le), k) for le, k in h["buckets"]] + [("+Inf", h["count"])]
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


class StoreCollector(Collector):
    """The ``kvstore_*`` series of one store, read from its ``stats()``."""

    def __init__(self, store: PrefixStore):
        self.store = store

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.store.stats()
        except StoreClosedError:  # a scrape racing the server's shutdown
            return
        if "tokens_device" in stats:  # tiers apart: the store's tokens_ram counts the device-served tokens too
            stats["tokens_ram"] -= stats["tokens_device"]
        yield from _families(CounterMetricFamily, COUNTERS, stats)
        yield from _labelled(stats)
        yield from _histograms(stats)
        yield from _families(GaugeMetricFamily, GAUGES, stats)


def with_metrics(handler: type, store: PrefixStore) -> type:
    """``handler`` (an ``http.server`` handler class) answering ``GET /metrics``
    with ``store``'s metrics in Prometheus' text format; other requests as before."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))

    class MetricsHandler(handler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                return super().do_GET()
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return MetricsHandler
