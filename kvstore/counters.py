"""What a store counts: this process's counters, the part of them not yet
added to the store's lifetime totals on disk, block uses not yet saved, and
the latency of the engine-thread calls (this process's histograms only)."""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Iterable, Optional

from .blocks.record import Use
from .hit import REASONS

NAMES = ("hits", "misses", "tokens_requested", "tokens_ram", "tokens_ssd", "puts", "blocks_written",
         "bytes_written",  # payload bytes of the blocks written to the SSD tier (blocks_written)
         "evicted_unadmitted",  # blocks dropped from RAM never admitted to the SSD tier (ssd_admit="reuse")
         "evictions_ram", "evictions_ssd", "corrupt_blocks", "write_errors", "blocks_stored",
         "blocks_gone",  # blocks the index had on disk that another process removed (kvstore clear): forgotten
         "writer_us",  # time the writer spent on jobs (encoding, and writing where there is a disk tier)
         "fetch_waited_us",  # time fetches waited for the writer to store blocks they serve (put just before)
         "tokens_queued",  # of tokens_ram, tokens copied from a put's own arrays before the writer stored them
         "puts_skipped", "blocks_skipped",  # puts not stored (whole): queued puts held past the bound (a burst)
         "puts_superseded",  # queued puts whose blocks a later put of a longer prompt took over (their arrays let go)
         "evicted_unwritten",  # blocks evicted from RAM before their write to disk finished (the writer holds them)
         "tokens_skipped_cost",  # stored tokens not served: recomputing was predicted faster (or a near tie)
         "predicted_us", "actual_us",  # predicted and measured load time of hits served as planned
         # the remote tier (remote_sync, discovery)
         "tokens_remote",  # tokens served from blocks this fetch read from the remote
         "remote_lookups", "remote_blocks_read", "remote_bytes_read", "remote_blocks_written", "remote_bytes_written",
         "remote_skipped",  # copies not sent: the queue was full (remote slower than the engine) or the remote down
         "remote_bypassed",  # fetches that did not ask the remote: it was down (breaker open)
         "remote_errors",  # failed calls: refused connections, timeouts
         "remote_bad",  # remote values refused: checksum, key binding, record or tokens that do not fit
         "remote_unauthenticated",  # remote blocks skipped: no valid MAC under this store's remote_secret
         "remote_block_size_mismatch",  # models the remote holds in blocks of another size (shared with nothing)
         "tokens_device",  # of tokens_ram, tokens served from device copies
         ) + tuple("not_served_" + r for r in REASONS)  # prompt tokens not served, by reason (``Hit.not_served``)

# Upper bounds (seconds) of the latency histograms' buckets: a RAM hit's tenth of a millisecond to a cold
# remote fetch's seconds. Fixed, so a process's histograms add up across processes (Prometheus' ``le``).
BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TIMED = ("fetch", "put")  # the engine-thread calls timed (``stats()``: ``fetch_seconds``, ``put_seconds``)


class Counters:
    """Thread-safe counters (a small lock of their own, never held across I/O)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.now = dict.fromkeys(NAMES, 0)
        self._unsaved = dict.fromkeys(NAMES, 0)
        self._uses: dict[bytes, tuple[float, int]] = {}  # key -> (last use, hits): a ``Use`` once drained
        # per timed call: observations per bucket (the last past every bound) and their sum; this process's only
        self._hist = {name: [0] * (len(BOUNDS) + 1) for name in TIMED}
        self._sums = dict.fromkeys(TIMED, 0.0)

    def count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self.now[name] += k
            self._unsaved[name] += k

    def observe(self, name: str, seconds: float, count: Optional[str] = None) -> None:
        """``seconds`` into the ``name`` latency histogram (and the counter ``count`` + 1: a put times and
        counts itself in one lock)."""
        with self._lock:
            self._observe(name, seconds)
            if count is not None:
                self.now[count] += 1
                self._unsaved[count] += 1

    def _observe(self, name: str, seconds: float) -> None:  # (the lock held)
        self._hist[name][bisect_left(BOUNDS, seconds)] += 1
        self._sums[name] += seconds

    def record(self, deltas: dict[str, int], used: Iterable[bytes] = (), when: float = 0.0,
               not_served: Optional[dict[str, int]] = None, seconds: Optional[float] = None) -> None:
        """A fetch's counts, its tokens not served by reason, the blocks with a disk copy it served at ``when``
        and the ``seconds`` it took (the fetch histogram), at once: one lock, the fetch path's only one here."""
        if not_served:
            deltas = dict(deltas, **{"not_served_" + r: k for r, k in not_served.items()})
        with self._lock:
            if seconds is not None:
                self._observe("fetch", seconds)
            for name, k in deltas.items():
                if k:
                    self.now[name] += k
                    self._unsaved[name] += k
            for key in used:
                old = self._uses.get(key)
                self._uses[key] = (when, 1 + (old[1] if old else 0))

    def snapshot(self) -> dict:
        """The counts, with the tokens not served as one dict (``tokens_not_served``: reason -> tokens), and
        per timed call ``NAME_seconds``: ``{"buckets": [[le, observations <= le], ...], "sum", "count"}``
        (the buckets cumulative, as Prometheus has them; ``count`` is the ``+Inf`` one)."""
        with self._lock:
            out = dict(self.now)
            for name, counts in self._hist.items():
                total, buckets = 0, []
                for le, k in zip(BOUNDS, counts):
                    total += k
                    buckets.append([le, total])
                out[f"{name}_seconds"] = {"buckets": buckets, "sum": self._sums[name], "count": total + counts[-1]}
        out["tokens_not_served"] = {r: out.pop("not_served_" + r) for r in REASONS}
        return out

    def drain(self) -> tuple[dict[bytes, Use], dict[str, int]]:
        """Uses and lifetime deltas not saved yet (and forget them)."""
        with self._lock:
            uses, self._uses = {k: Use(*u) for k, u in self._uses.items()}, {}
            deltas = {k: v for k, v in self._unsaved.items() if v}
            self._unsaved = dict.fromkeys(NAMES, 0)
        return uses, deltas

    def restore(self, uses: dict[bytes, Use], deltas: dict[str, int]) -> None:
        """Put back what a failed save drained (newer uses win)."""
        with self._lock:
            for k, u in uses.items():
                new = self._uses.get(k)
                self._uses[k] = (u.when, u.hits) if new is None else (max(u.when, new[0]), u.hits + new[1])
            for k, v in deltas.items():
                self._unsaved[k] += v
