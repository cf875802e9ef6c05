"""The store's side of its remote tier: every call guarded, copies written
behind the engine's back.

The remote is a best-effort, shared cache that may vanish at any time; the
local tiers stay authoritative. So:

- every call runs under short socket timeouts and a ``Breaker``: after a
  failure the remote is skipped for a backoff (0.5 s doubling to 15 s), then
  tried again; a fetch never waits on a down server longer than one timeout,
  and the engine never sees its errors (one warning, counters in ``stats()``);
- copies of new blocks go out on a background thread, in pipelined batches,
  after the local write. The queue is bounded by bytes: when the remote is
  slower than the engine, later copies are skipped and counted (the local
  copy exists), never queued without limit, and never the engine's wait; a
  write transaction's blocks are queued or skipped together, so the remote
  never holds a prompt's blocks with a gap;
- a server that cannot be reached at open is the same case: the store opens
  on its local tiers and the breaker connects later. A malformed URL or
  refused credentials are configuration errors, raised at open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np

from ...background import running
from ...config import StoreConfig
from ...counters import Counters
from ...errors import RemoteConfigError
from ...blocks.record import Entry
from .tier import RemoteTier
from .auth import secret_bytes

log = logging.getLogger("kvstore")

T = TypeVar("T")



class Breaker:
    """Closed while calls succeed; a failure opens it for a backoff that
    doubles with each failure in a row (``first`` .. ``cap`` seconds), after
    which calls are let through again."""

    def __init__(self, first: float = 0.5, cap: float = 15.0, clock: Callable[[], float] = time.monotonic):
        self.first, self.cap, self.clock = first, cap, clock
        self._lock = threading.Lock()
        self._backoff = first
        self._until: Optional[float] = None

    @property
    def closed(self) -> bool:
        return self._until is None

    def allow(self) -> bool:
        with self._lock:
            return self._until is None or self.clock() >= self._until

    def succeeded(self) -> bool:
        """Close; True when it was open (the remote is back)."""
        with self._lock:
            was_open = self._until is not None
            self._until, self._backoff = None, self.first
            return was_open

    def failed(self, backoff: Optional[float] = None) -> bool:
        """Open for the next backoff; True when it was closed."""
        with self._lock:
            was_closed = self._until is None
            wait = self._backoff if backoff is None else backoff
            self._until = self.clock() + wait
            self._backoff = min(self.cap, self._backoff * 2)
            return was_closed


class _Skipped(Exception):
    """The breaker is open: the call was not made."""


@dataclass(frozen=True)
class ModelInfo:
    """A model's description, queued among the blocks (written in order)."""

    root: bytes
    info: dict


class Remote:
    """A remote tier behind a breaker, with a bounded write-behind queue: the
    one holder of the store's ``RemoteTier`` (the rest of the store asks it)."""

    def __init__(self, url: str, namespace: Optional[str], counters: Counters, config: StoreConfig = StoreConfig()):
        self._tier = RemoteTier(url, namespace, float(config.remote_timeout),  # a malformed URL raises here
                               read_bytes=config.tuning.remote_read_bytes, secret=secret_bytes(config.remote_secret))
        self.counters = counters
        self.breaker = Breaker()
        self.config = config
        self.queue_bytes = config.tuning.remote_queue_bytes
        self._warned = False
        self._other_sizes: dict[bytes, int] = {}  # model root -> the block size the remote holds it in, not ours
        self._cond = threading.Condition()
        self._queue: "deque[Union[Entry, ModelInfo]]" = deque()
        self._queued = 0  # payload bytes queued or being sent (what the bound counts)
        self._busy = False  # a batch is being written
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        try:
            self._tier.connect()
        except RemoteConfigError:
            raise
        except Exception as e:  # down or unreachable: open on the local tiers, connect later
            self._failed(e)

    @property
    def url(self) -> str:
        return self._tier.url.shown

    # ------------------------------------------------------------- guarded

    def available(self) -> bool:
        """Whether the breaker lets a call through now (a down server is skipped until its back-off ends)."""
        return self.breaker.allow()

    def call(self, fn: Callable[..., T], *args) -> Optional[T]:
        """``fn(*args)`` against the server, or ``None`` when the breaker is
        open or the call failed (counted, warned once). Never raises."""
        try:
            return self._call(fn, *args)
        except _Skipped:
            return None
        except RemoteConfigError as e:  # credentials changed under a running store: not the engine's problem
            self._failed(e, backoff=self.breaker.cap)
        except Exception as e:
            self._failed(e)
        return None

    def _call(self, fn: Callable[..., T], *args) -> T:
        if not self.breaker.allow():
            raise _Skipped
        if not self._tier.connected:
            self._tier.connect()
        out = fn(*args)
        if self.breaker.succeeded():
            log.info("kvstore: remote %s is reachable again", self.url)
        return out

    def _failed(self, e: BaseException, backoff: Optional[float] = None) -> None:
        self.counters.count("remote_errors")
        if self.breaker.failed(backoff):
            if not self._warned:
                self._warned = True
                log.warning("kvstore: remote %s failed (%s: %s); serving from the local tiers and retrying "
                            "in the background (see stats()['remote_errors'])", self.url, type(e).__name__, e)
            else:
                log.info("kvstore: remote %s failed again (%s: %s)", self.url, type(e).__name__, e)

    # ------------------------------------------- reads, guarded as ``call``

    def probe(self, root: bytes, keys: Sequence[bytes], near: Optional[tuple[bytes, np.ndarray]]) -> Optional[tuple]:
        """``RemoteTier.probe`` (records of ``keys``, children nearest ``near``: one round trip), or ``None``."""
        return self.call(self._tier.probe, root, keys, near)

    def neighbours(self, root: bytes, parent: bytes, tokens: np.ndarray) -> Optional[list]:
        """``RemoteTier.neighbours``: the stored children of ``parent`` nearest ``tokens``, or ``None``."""
        return self.call(self._tier.neighbours, root, parent, tokens)

    def read(self, keys: Sequence[bytes], sizes: Sequence[int], take: Callable[[Iterator[tuple]], T]) -> Optional[T]:
        """``take(entries)`` of the blocks of ``keys`` as they stream in (``RemoteTier.entries``), or ``None``."""
        return self.call(lambda: take(self._tier.entries(keys, sizes)))

    def forget_child(self, root: bytes, parent: bytes, member: bytes) -> None:
        """Drop ``member`` from ``parent``'s listing (the block it named was evicted)."""
        self.call(self._tier.forget_child, root, parent, member)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Delete blocks from the server (ones refused as bad)."""
        self.call(self._tier.remove, keys)

    # -------------------------------------------------------- write-behind

    def offer(self, entries: Sequence[Entry]) -> None:
        """Queue copies of blocks just kept locally (one write transaction's:
        new blocks of a prompt, parents first); skips (and counts) what cannot
        go now. Never blocks. The bound is taken per offer, not per block: an
        offer is queued whole while the queue is under its bound (which it may
        pass by one offer) and skipped whole otherwise, since a block whose
        parent was skipped could never be served from the remote."""
        if not entries:
            return
        with self._cond:
            take = not self._stop and self.breaker.allow() and self._queued < self.queue_bytes
            if take:
                self._queue.extend(entries)
                self._queued += sum(len(e.payload) for e in entries)
                self._cond.notify()
        if not take:
            self.counters.count("remote_skipped", len(entries))
        self._ensure_thread()

    def register_model(self, root: bytes, info: dict) -> None:
        with self._cond:
            self._queue.append(ModelInfo(root, info))
            self._cond.notify()
        self._ensure_thread()

    def other_block_size(self, root: bytes) -> Optional[int]:
        """The block size the hosts before this one store the model ``root`` in, where it is not this store's
        (a dict read: the remote thread writes it)."""
        return self._other_sizes.get(root)

    def _same_blocks(self, root: bytes, ours: dict, theirs: Optional[dict]) -> None:
        """Warn where the hosts before this one store the model in blocks of another size: a block's key
        hashes its tokens, so the two share nothing (never wrong KV: every hit is checked token by token)."""
        size = (theirs or {}).get("block_size")
        if isinstance(size, int) and size != ours.get("block_size"):
            log.warning("kvstore: remote %s holds model %s in blocks of %d tokens, this store in blocks of %s: "
                        "they share nothing. Give every host of a namespace one block size (block_size / "
                        "--block-size).", self.url, ours.get("model_key"), size, ours.get("block_size"))
            self.counters.count("remote_block_size_mismatch")
            self._other_sizes[root] = size

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the queue is written (or skipped); True when it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def close(self) -> None:
        if not self.flush(self.config.tuning.remote_close_wait):
            log.warning("kvstore: remote %s: %d MiB of copies not sent at close", self.url, self._queued >> 20)
        with self._cond:
            self._stop = True
            dropped = [e for e in self._queue if isinstance(e, Entry)]
            self._queued -= sum(len(e.payload) for e in dropped)
            self._queue.clear()
            self._cond.notify_all()
        if dropped:
            self.counters.count("remote_skipped", len(dropped))
        if self._thread is not None:
            self._thread.join(timeout=self.config.tuning.remote_close_wait)
        self._tier.close()

    def stats(self) -> dict:
        return {"remote_url": self.url, "remote_up": self.breaker.closed and self._tier.connected,
                "remote_cluster": self._tier.cluster, "remote_queue_bytes": self._queued,
                "remote_authenticated": self._tier.signer is not None}

    def _ensure_thread(self) -> None:
        with self._cond:
            if not self._stop:
                self._thread, _ = running(self._thread, None, lambda _: self._loop(), "kvstore-remote")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch, size = [], 0
                cfg = self.config
                while self._queue and len(batch) < cfg.tuning.remote_batch_blocks and (
                        not batch or size < cfg.tuning.remote_batch_bytes):
                    item = self._queue.popleft()
                    batch.append(item)
                    if isinstance(item, Entry):
                        size += len(item.payload)
                self._busy = True
            try:
                self._send(batch, size)
            finally:
                with self._cond:
                    self._queued -= size
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, batch: list, size: int) -> None:
        blocks = [(e.record, e.payload) for e in batch if isinstance(e, Entry)]
        for m in batch:
            if isinstance(m, ModelInfo):
                self._same_blocks(m.root, m.info, self.call(self._tier.register_model, m.root, m.info))
        if not blocks:
            return
        try:
            self._call(self._tier.put_many, blocks)
        except _Skipped:
            self.counters.count("remote_skipped", len(blocks))
            return
        except Exception as e:
            self._failed(e, backoff=self.breaker.cap if isinstance(e, RemoteConfigError) else None)
            self.counters.count("remote_skipped", len(blocks))
            return
        self.counters.count("remote_blocks_written", len(blocks))
        self.counters.count("remote_bytes_written", size)
