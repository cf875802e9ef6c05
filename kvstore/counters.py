"""What a store counts: this process's counters, the part of them not yet
added to the store's lifetime totals on disk, and block uses not yet saved."""

from __future__ import annotations

import threading
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


class Counters:
    """Thread-safe counters (a small lock of their own, never held across I/O)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.now = dict.fromkeys(NAMES, 0)
        self._unsaved = dict.fromkeys(NAMES, 0)
        self._uses: dict[bytes, tuple[float, int]] = {}  # key -> (last use, hits): a ``Use`` once drained

    def count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self.now[name] += k
            self._unsaved[name] += k

    def record(self, deltas: dict[str, int], used: Iterable[bytes] = (), when: float = 0.0,
               not_served: Optional[dict[str, int]] = None) -> None:
        """A fetch's counts, its tokens not served by reason and the blocks with a disk copy it served at
        ``when``, at once (one lock)."""
        if not_served:
            deltas = dict(deltas, **{"not_served_" + r: k for r, k in not_served.items()})
        with self._lock:
            for name, k in deltas.items():
                if k:
                    self.now[name] += k
                    self._unsaved[name] += k
            for key in used:
                old = self._uses.get(key)
                self._uses[key] = (when, 1 + (old[1] if old else 0))

    def snapshot(self) -> dict:
        """The counts, with the tokens not served as one dict (``tokens_not_served``: reason -> tokens)."""
        with self._lock:
            out = dict(self.now)
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
