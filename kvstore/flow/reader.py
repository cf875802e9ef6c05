"""The read path: a pinned path's blocks, from RAM, from disk or as just
read from the remote, checked against the prompt and gathered into one
tensor per layer; blocks served from disk promoted to RAM afterwards, off
the caller's path.

Disk blocks are read and assembled inside one read transaction, straight
from the mapped pages (``gather``). A bad block (foreign tokens, a failed
checksum) cuts the hit and leaves the store; a block another process removed
leaves the index. Neither ever raises into the engine.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from ..background import Pools
from ..blocks.ondevice import DeviceBlock
from ..blocks.wire import Stored
from ..counters import Counters
from .disk import Disk
from ..errors import BlockDecodeError
from ..convert.gather import HostFill, gather
from ..state.index import BlockRef
from ..state.lookup import servable
from ..gpu.backend import Backend, choose
from ..state.table import BlockTable

log = logging.getLogger("kvstore")


@dataclass
class Served:
    """What ``read`` served: layers of ``[0, length)``, and per block used
    (``used``), whether it came from RAM and its stored bytes; the device
    copies the gather made (for the device tier)."""

    layers: list
    length: int
    from_ram: list[bool]
    nbytes: list[int]
    used: list[BlockRef]
    on_device: list
    device: list[bool] = field(default_factory=list)  # per block used, whether it was a device copy
    short: str = ""  # why it serves less than asked, where a block failed: "corrupt", "evicted", "unavailable"


class Reader:
    def __init__(self, table: BlockTable, disk: Optional[Disk], counters: Counters, writable: bool,
                 backend: Optional[Backend] = None):
        self.table = table
        self.disk = disk
        self.counters = counters
        self.writable = writable
        self.backend = backend or choose()  # the store's (``gpu.backend``)
        self._lock = threading.Lock()  # guards the promotions in flight (nothing of the table's)
        self._promoting: dict[bytes, Future] = {}
        self._pool = Pools("kvstore-promote")

    def read(self, path: list[BlockRef], items: list, toks: np.ndarray, length: int,
             quantized: Optional[tuple[int, int]] = None, cold: frozenset = frozenset(),
             found: Optional[dict[bytes, Stored]] = None, fill: Optional[HostFill] = None) -> Served:
        """The layers of ``path``'s blocks for ``[0, length)``. ``items``: per
        block, its device copy or RAM bytes as pinned, else ``None`` (read from
        disk here); ``cold``: keys of disk blocks the cost plan found out of the
        page cache (read ahead); ``found``: blocks just read from the remote,
        served as they are, and ``fill``, the arrays they were placed in as they
        came. Called with ``path`` pinned."""
        items = list(items)
        from_ram = [b is not None for b in items]
        if found:
            items = [it if it is not None else found.get(p.key) for p, it in zip(path, items)]
        bad: list[tuple[BlockRef, str]] = []  # dropped after the read transaction: no write inside one
        gone: list[BlockRef] = []
        if all(it is not None for it in items) or self.disk is None:
            served = self._serve(path, items, from_ram, toks, length, quantized, bad, fill)
        else:
            ahead: list[Future] = []
            try:
                want = [p.key for p, it in zip(path, items) if it is None and p.key in cold]
                ahead = self.disk.read_ahead(want) if len(want) > 1 else []  # a cached block's pages are left alone
                with self.disk.reading() as txn:
                    self._from_disk(txn, path, items, bad, gone)
                    served = self._serve(path, items, from_ram, toks, length, quantized, bad, fill)
            except Exception as e:
                self.disk.read_failed("read", e)
                k = next((i for i, p in enumerate(path) if not from_ram[i] and p.key not in (found or ())), len(path))
                served = replace(self._serve(path[:k], items[:k], from_ram[:k], toks, length, quantized, bad),
                                 short="unavailable")
            finally:
                wait(ahead)  # (outside the read transaction: a read-ahead may wait on a resize that waits on it)
        return self._faults(served, bad, gone)

    def _faults(self, served: Served, bad: list[tuple[BlockRef, str]], gone: list[BlockRef]) -> Served:
        """Drop the blocks found bad (and forget those another process removed); say why the read stopped."""
        for p, why in bad:
            self._drop_bad(p, why)
        for p in gone:
            self.counters.count("blocks_gone")
            self.table.disk.gone(p)
        if bad or gone:
            served.short = "corrupt" if bad else "evicted"
        return served

    def _from_disk(self, txn, path: list[BlockRef], items: list, bad: list, gone: list) -> None:
        """Fill ``items``' gaps with views of the map, in order, up to the first
        block that is bad or gone (another process removed it: `kvstore clear`,
        its eviction)."""
        for i, p in enumerate(path):
            if items[i] is not None:
                continue
            try:
                got = txn.stored(p.key, p.start, unread=True)  # read while copied
            except BlockDecodeError as e:
                bad.append((p, str(e)))
                return
            if got is None:
                gone.append(p)
                return
            if p.offset < 0:
                self.table.disk.offset_found(p, txn.offset_of(got.buf))
            items[i] = got

    def _serve(self, path, items, from_ram, toks, length, quantized, bad: list,
               fill: Optional[HostFill] = None) -> Served:
        """Cut at the first missing or foreign block, gather, and retry
        shorter when a payload fails its checksum."""
        good = 0
        for p, it in zip(path, items):
            if it is None:
                break
            if not tokens_match(it, toks, p.start, min(p.end, length)):
                bad.append((p, "tokens do not match the prompt (hash collision?)"))
                break
            good += 1
        while True:
            if good < len(path):
                path, items, from_ram = path[:good], items[:good], from_ram[:good]
                length = servable(path, min(length, path[-1].end)) if path else 0
            if length == 0:
                return Served([], 0, [], [], [], [])
            path_used = [p for p in path if p.start < length]
            k = len(path_used)
            try:
                got = gather(items[:k], length, quantized, keep_on_device=self.table.device_budget > 0, fill=fill,
                             backend=self.backend)
            except Exception as e:  # blocks that do not fit together (a reused model key, a bad index record)
                log.warning("kvstore: stored blocks for this prompt do not fit together (%s); serving a miss", e)
                return Served([], 0, [], [], [], [])
            if got.bad is None:
                break
            bad.append((path_used[got.bad], "payload checksum mismatch"))
            good = got.bad
        return Served(got.layers, got.length, from_ram[:k], [it.nbytes for it in items[:k]], path_used,
                      got.on_device or [], [isinstance(it, DeviceBlock) for it in items[:k]])

    def _drop_bad(self, node: BlockRef, why: str) -> None:
        self.counters.count("corrupt_blocks")
        log.warning("kvstore: block %s (tokens %d-%d) is bad: %s; serving a shorter prefix",
                    node.key.hex()[:16], node.start, node.end, why)
        keys = self.table.bad(node)
        if self.writable and self.disk is not None:
            self.disk.delete(keys)

    # ----------------------------------------------------------- promotion

    def promote_later(self, nodes: list[BlockRef]) -> None:
        """Copy blocks just served from disk (those ``BlockTable.served`` found
        worth it) into RAM on a thread of its own: the hit that read them does
        not wait for the copies."""
        if not nodes or self.disk is None:
            return
        with self._lock:
            fut = self._pool.get().submit(self._promote, nodes)
            for p in nodes:
                self._promoting[p.key] = fut

    def settle(self) -> None:
        """Wait for every promotion started so far."""
        with self._lock:
            futs = {id(f): f for f in self._promoting.values()}
        for f in futs.values():
            f.result()

    def wait_promotions(self, keys: Sequence[bytes]) -> None:
        if not self._promoting:  # (a dict read: none in flight, no lock needed)
            return
        with self._lock:
            futs = {id(f): f for k in keys if (f := self._promoting.get(k)) is not None}
        for f in futs.values():
            f.result()

    def _promote(self, nodes: list[BlockRef]) -> None:
        try:
            held: list[Stored] = []
            with self.disk.reading() as txn:  # one copy of each value out of the map (checked), no decode
                for p in nodes:
                    try:
                        got = txn.stored(p.key, p.start)
                    except BlockDecodeError:
                        got = None
                    got = got.held() if got is not None else None
                    if got is None:
                        break
                    held.append(got)
            for p, b in zip(nodes, held):
                self.table.promoted(p, b)  # (unless in RAM meanwhile)
        except Exception as e:  # a cache: a failed promotion only means the next hit reads the disk again
            log.debug("kvstore: promotion failed: %s", e)
        finally:
            with self._lock:
                for p in nodes:
                    self._promoting.pop(p.key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def tokens_match(item: Stored, toks: np.ndarray, start: int, stop: int) -> bool:
    """Whether a stored block's tokens are the prompt's ``[start, stop)``."""
    tokens = item.tokens
    m = stop - start
    return m <= len(tokens) and np.array_equal(tokens[:m], toks[start:stop])
