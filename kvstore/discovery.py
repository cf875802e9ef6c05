"""A fetch that stops locally asks the remote tier for the rest of the chain.

Block keys are content addresses, so the keys the prompt's next blocks
would have are known without asking anyone (``KeyChain``): one pipelined
round trip reads their index records (small), and the run of blocks whose
records fit the prompt -- same root, parent, position and tokens -- is read in
a second (payloads, in round trips of about 64 MiB). Every payload is
decoded as a local one is (header, checksum, key binding), and its tokens are
compared again: a corrupt, foreign or colliding value is refused and
dropped from the server, never served.

What was read joins the index below where the walk stopped, goes into RAM,
and is written to the LMDB tier by the background writer (as a job of
already encoded blocks, so it is never copied back to the remote). Only the
full blocks of the prompt and an exact tail (a repeat of a stored prompt's
length) can be found this way: other partial blocks need a listing of
children that the remote does not keep.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import numpy as np

from .codec import Block, deserialize
from .counters import Counters
from .errors import BlockDecodeError
from .hashing import KeyChain
from .index import Node, RadixIndex
from .lookup import Match
from .placement import Placement
from .record import BlockRecord
from .remote_sync import Remote
from .tiers.base import Entry
from .writer import Job, Writer

log = logging.getLogger("kvstore")

MAX_PROBE = 1024  # blocks asked for in one fetch (256K tokens at the default block size)


class Discovery:
    def __init__(self, remote: Remote, placement: Placement, writer: Writer, lock, counters: Counters,
                 keep_on_disk: bool):
        self.remote = remote
        self.placement = placement
        self.index = placement.index
        self.writer = writer
        self.lock = lock
        self.counters = counters
        self.keep_on_disk = keep_on_disk

    def find(self, root: Node, chain: KeyChain, n: int, match: Match) -> set[bytes]:
        """Index the blocks of ``chain.tokens[:n]`` the remote holds beyond
        ``match``; returns their keys. Never raises; a down remote costs at
        most one timeout (then the breaker skips it)."""
        probe = _probe(chain, n, len(match.full.nodes))
        if not probe:
            return set()
        raw = self.remote.call(self.remote.tier.records, [key for key, *_ in probe])
        if raw is None:
            if not self.remote.breaker.allow():
                self.counters.count("remote_bypassed")
            return set()
        self.counters.count("remote_lookups")
        run = self._records(root, chain, probe, raw)
        if not run:
            return set()
        bufs = self.remote.call(self.remote.tier.payloads, [r.key for r in run], [r.nbytes for r in run])
        got: list[tuple[BlockRecord, Block, bytes]] = []
        for rec, buf in zip(run, bufs or []):
            if buf is None:
                break  # evicted by the server meanwhile
            block = self._decode(rec, buf)
            if block is None:
                break
            got.append((rec, block, buf))
        if not got:
            return set()
        self.counters.count("remote_blocks_read", len(got))
        self.counters.count("remote_bytes_read", sum(len(b) for _, _, b in got))
        return self._keep(match.full.last, got, chain)

    # ---------------------------------------------------------------- steps

    def _records(self, root: Node, chain: KeyChain, probe: list, raw: list) -> list[BlockRecord]:
        """The leading run of probed blocks whose records fit the prompt."""
        run = []
        for (key, parent, start, length), r in zip(probe, raw):
            if r is None:
                if length == chain.block_size:
                    break  # the chain stops here: no later block can be used
                continue
            rec = BlockRecord.unpack(key, r) if isinstance(r, bytes) else None
            why = _mismatch(rec, root.key, parent, start, length, chain.tokens)
            if why:
                self._refuse(key, why if rec is not None or isinstance(r, bytes) else f"not a kvstore block ({r})")
                break
            run.append(rec)
        return run

    def _decode(self, rec: BlockRecord, buf) -> Optional[Block]:
        if not isinstance(buf, bytes):
            self._refuse(rec.key, f"not a kvstore block ({buf})")
            return None
        try:
            block = deserialize(buf, rec.start, key=rec.key)
        except BlockDecodeError as e:
            self._refuse(rec.key, str(e))
            return None
        if not np.array_equal(block.tokens, rec.tokens):
            self._refuse(rec.key, "payload tokens differ from its record")
            return None
        return block

    def _refuse(self, key: bytes, why: str) -> None:
        self.counters.count("remote_bad")
        log.warning("kvstore: remote block %s refused: %s; it is deleted from %s", key.hex()[:16], why,
                    self.remote.url)
        self.remote.call(self.remote.tier.remove, [key])

    def _keep(self, parent: Node, got: list[tuple[BlockRecord, Block, bytes]], chain: KeyChain) -> set[bytes]:
        """Index ``got`` below ``parent``, into RAM; queue the disk write."""
        fresh: list[tuple[Node, Entry]] = []
        pinned: list[Node] = []
        now = time.time()
        job: Optional[Job] = None
        with self.lock:
            if not (parent.is_root or self.index.get(parent.key) is parent):
                return set()  # dropped while we read
            for rec, block, buf in got:
                node = self.index.get(rec.key)
                if node is None:
                    try:
                        node = self.index.add(parent, rec.key, rec.start, rec.length, rec.first, rec.snap, rec.gap,
                                              rec.first_row if rec.gap else None)
                    except (KeyError, ValueError):
                        break
                    node.used = now
                    entry = Entry(replace(rec, nbytes=len(buf), created=now, used=now, hits=0), block)
                    entry.payload = buf  # the remote's bytes are LMDB's bytes: no second serialization
                    fresh.append((node, entry))
                elif node.parent is not parent:
                    break
                RadixIndex.pin([node])  # promoting the next one must not evict this one
                pinned.append(node)
                if not node.in_ram:
                    self.placement.promote_locked(node, block)
                parent = node
            if fresh and self.keep_on_disk:
                job = Job([nd for nd, _ in fresh], chain.root, chain.tokens, [],
                          sum(len(e.payload) for _, e in fresh), found={e.key: e for _, e in fresh})
                for nd, _ in fresh:
                    nd.job = job  # evicted from RAM before its disk write, it stays indexed
            RadixIndex.unpin(pinned)
            if job is None:
                for nd, _ in fresh:
                    if not nd.in_ram:
                        self.placement.forget_locked(nd)  # held nowhere (and the blocks below it with it)
                        break
        if job is not None:
            self.writer.submit(job)
        return {nd.key for nd, _ in fresh}


def _probe(chain: KeyChain, n: int, first: int) -> list[tuple[bytes, bytes, int, int]]:
    """``(key, parent key, start, length)`` of the prompt's blocks from full
    block ``first`` on, and its exact tail when every full block is probed."""
    bs = chain.block_size
    full = n // bs
    last = min(full, first + MAX_PROBE)
    out = [(chain.key(i), chain.parent(i), i * bs, bs) for i in range(first, last)]
    tail = n - full * bs
    if tail and last == full:
        out.append((chain.tail_key(full, tail), chain.parent(full), full * bs, tail))
    return out


def _mismatch(rec: Optional[BlockRecord], root: bytes, parent: bytes, start: int, length: int,
              tokens: np.ndarray) -> Optional[str]:
    if rec is None:
        return "unreadable index record"
    if rec.root != root or rec.parent != parent:
        return "record of another chain"
    if rec.start != start or rec.length != length:
        return f"record at tokens {rec.start}+{rec.length}, expected {start}+{length}"
    if not np.array_equal(rec.tokens, tokens[start : start + length]):
        return "tokens differ from the prompt (hash collision?)"
    return None
