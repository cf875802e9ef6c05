"""The fetch path, one pass: match -> discover -> pin -> plan -> read ->
account -> release.

- **match**: the table's ``lookup`` (one lock) gives the prompt's whole
  blocks by key and the blocks it may end inside of; their tokens come from
  RAM, the put still storing them, or the disk (outside the lock). Where the
  index cannot serve the prompt as far as asked, the disk is asked for
  blocks other processes wrote below where the walk stopped, and the lookup
  is made again.
- **discover**: what the local tiers lack, from the remote (``Discovery``).
- **pin**: the servable path held in place, where each block is, and the
  puts still storing blocks of it (one lock).
- **plan**: how much is worth loading (``Planner``; a queued put's rows are
  in hand, at no cost).
- **read**: device copies, RAM bytes, LMDB pages and remote bytes, checked
  against the prompt and gathered (``Reader``); a queued put's rows joined.
- **account**: the table told what was served (one lock: use order, device
  copies, promotions, unpinning), the counters once.

Every block served is compared with the prompt's own tokens, so a hash
collision or a bad block shortens the hit; no storage fault reaches the
engine.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Callable, NamedTuple, Optional

import numpy as np

from ..blocks.hashing import KeyChain
from ..convert.queued import joined, owned
from ..cost.planner import Planner
from ..counters import Counters
from ..hit import Hit
from ..state.index import BlockRef
from ..state.lookup import shared_prefix
from ..state.plans import Candidate, Lookup, Pinned
from ..state.table import BlockTable
from . import reasons
from .discovery import Discovery, Found
from .disk import Disk
from .priority import EngineFirst
from .reader import Reader
from .writer import Writer


class Match(NamedTuple):
    """Stored blocks along a prompt: ``path`` shares ``matched`` tokens with it; ``full`` is the lookup of
    its whole blocks (``path`` may add one block the prompt ends or diverges inside of)."""

    full: Lookup
    path: list[BlockRef]
    matched: int


class Narrowed(NamedTuple):
    """How far a fetch got at each step (``reasons.spans``): served, planned, servable, matched, asked."""

    served: int
    planned: int
    servable: int
    matched: int
    limit: int


class Unstored(NamedTuple):
    """``FetchPath.unstored``: per whole block, why this process dropped it (``None``: not known); the token up to
    which another model key of the store holds the prompt (``other_model``), and that key (``None``: nobody, or
    the remote in blocks of another size)."""

    known: list[Optional[str]]
    elsewhere: int = 0
    holder: Optional[bytes] = None


class FetchPath:
    """The store's fetch, from a prompt's tokens to a ``Hit``: it sequences the table, the disk, the remote,
    the planner, the reader and the writer's queued puts; it owns none of their state."""

    def __init__(self, table: BlockTable, disk: Optional[Disk], discovery: Optional[Discovery], planner: Planner,
                 reader: Reader, writer: Writer, counters: Counters, engine: EngineFirst, *,
                 block_size: int, from_queued: bool, reuse: Optional[Callable[[], None]]):
        self.table = table
        self.disk = disk
        self.discovery = discovery
        self.planner = planner
        self.reader = reader
        self.writer = writer
        self.counters = counters
        self.engine = engine
        self.block_size = block_size
        self.from_queued = from_queued  # a fetch may take a queued put's rows (not under ssd_admit="reuse")
        self.reuse = reuse  # ssd_admit="reuse" on a writable store: queue the admissions a hit earns

    # ---------------------------------------------------------------- match

    def match(self, root: bytes, chain: KeyChain, n: int) -> Match:
        """The stored blocks along ``chain.tokens[:n]``, asking the disk (outside the table's lock) for
        blocks other processes wrote where the index cannot serve as far as ``n``."""
        looked: set[bytes] = set()
        while True:
            got = self.table.lookup(root, chain, n)
            path, matched = list(got.path), got.length
            if matched < n and got.candidates:
                best, shared = self._best_partial(got.candidates, chain, matched, n)
                if best is not None:
                    path.append(best)
                    matched += shared
            stop = got.stop
            if self.disk is None or matched >= n or stop.key in looked or not (stop.is_root or stop.on_disk):
                return Match(got, path, matched)
            # partial blocks other processes wrote below the stop are found only on disk, even where this
            # process has children of its own there
            looked.add(stop.key)
            self.disk.discover(stop)

    def _best_partial(self, candidates: list[Candidate], chain: KeyChain, pos: int, n: int
                      ) -> tuple[Optional[BlockRef], int]:
        """The candidate sharing most tokens with the prompt at ``pos``: an exact tail block by key, others by
        comparing stored tokens."""
        i = pos // chain.block_size
        best, best_len = None, 0
        for c in candidates:
            ref = c.ref
            if ref.length <= n - pos and ref.key == chain.tail_key(i, ref.length):
                shared = ref.length
            else:
                stored = c.tokens if c.tokens is not None else self._stored_tokens(c)
                shared = 0 if stored is None else shared_prefix(stored, chain.tokens[pos:n])
            if shared > best_len:
                best, best_len = ref, shared
        return best, best_len

    def _stored_tokens(self, c: Candidate) -> Optional[np.ndarray]:
        """A block's tokens where RAM does not hold them: its put's, else the disk's."""
        if c.pending:
            got = self.writer.tokens(c.pending, c.ref.start, c.ref.end)
            if got is not None:
                return got
        if c.ref.on_disk and self.disk is not None:
            return self.disk.tokens(c.ref.key)
        return None

    # ---------------------------------------------------------------- fetch

    def fetch(self, root: bytes, toks: np.ndarray, n: int, quantized: Optional[tuple[int, int]]) -> Hit:
        started = time.perf_counter()  # (the fetch's time, counted with its other figures: ``kvstore_fetch_seconds``)
        chain = KeyChain(root, toks, self.block_size)
        match = self.match(root, chain, n)
        found = Found()  # blocks just read from the remote, served as they are
        copies: list[int] = []  # ... and their disk copies (the writer's ids), queued once the hit is served
        if self.discovery is not None and match.matched < n:
            found = self.discovery.find(root, chain, n, match, copies, quantized)
            if found.blocks:
                match = self.match(root, chain, n)
        self.reader.wait_promotions([p.key for p in match.path])
        pinned = self.table.pin(match.path, match.matched, found.blocks)
        try:
            return self._serve(chain, n, match.matched, pinned, found, quantized, started)
        finally:
            if not pinned.done:  # (not handed back to ``served``)
                self.table.release(pinned)
            for pending in copies:
                self.writer.submit(pending)

    def _serve(self, chain: KeyChain, n: int, matched: int, pinned: Pinned, found: Found,
               quantized: Optional[tuple[int, int]], started: float) -> Hit:
        root, toks = chain.root, chain.tokens
        length, jobs = pinned.length, pinned.pending
        tail = None  # rows [cut, length) taken from a put the writer has not stored yet: no wait for it
        if jobs and self.from_queued and quantized is None and not found.blocks:
            with self.engine.engine():
                tail = self.writer.queued_rows(jobs, toks, pinned.queued_from, length)
                if tail is not None and pinned.queued_from == 0:
                    why = self.not_served(chain, Narrowed(length, length, length, matched, n), found.unreachable)
                    return self._queued_hit(len(toks), length, owned(tail), why, started)
        cut = length if tail is None else pinned.queued_from
        waited = self._wait(pinned, found) if jobs and tail is None else 0
        with self.engine.engine():  # (not around the wait above: the writer would wait for it)
            # a queued put's rows (from ``cut`` on) are in hand: the plan weighs them, at no cost, with the rest
            plan = self.planner.plan(root, len(toks), pinned, found.blocks,
                                     frozenset(p.key for p in pinned.path if p.start >= cut))
            read_to = min(plan.length, cut)
            k = sum(1 for p in pinned.path if p.start < read_to)
            t0 = time.perf_counter()
            got = self.reader.read(pinned.path[:k], pinned.items[:k], toks, read_to, quantized, plan.cold,
                                   found.blocks, found.fill)
            t_load = time.perf_counter() - t0
            if tail is not None and plan.length > cut and got.length == cut:  # stored rows as stored, the put's
                got = replace(got, layers=joined(got.layers, tail), length=length)
            else:
                tail = None
        why = self.not_served(chain, Narrowed(got.length, plan.length, length, matched, n), found.unreachable,
                              got.short)
        return self._account(pinned, got, found, plan, tail, cut,
                             {"tokens_requested": len(toks), "tokens_skipped_cost": plan.skipped,
                              "fetch_waited_us": waited}, t_load, why, started)

    def not_served(self, chain: KeyChain, at: Narrowed, unreachable: bool, short: str = "") -> dict[str, int]:
        """Why each prompt token past ``at.served`` was not served (``reasons``): what is not stored is looked
        up only here, on the part not served (``unreachable``: the remote could not be asked). ``explain``'s
        dry run asks the same."""
        if at.served >= len(chain.tokens):
            return {}
        why, start, stop = reasons.spans(*at, len(chain.tokens), short)
        un = self.unstored(chain, start, stop)
        reasons.unmatched(why, start, stop, self.block_size, un.known, un.elsewhere, unreachable)
        return why

    def unstored(self, chain: KeyChain, start: int, stop: int) -> "Unstored":
        """What this store knows of the whole blocks in ``[start, stop)``, which no stored block covers."""
        blocks = reasons.whole_blocks(start, stop, self.block_size)
        if not blocks:
            return Unstored([])
        known, others = self.table.missing([chain.key(i) for i in blocks], chain.root)
        return Unstored(known, *self._elsewhere(chain, others, stop)) if None in known else Unstored(known)

    def _elsewhere(self, chain: KeyChain, others: list[bytes], stop: int) -> tuple[int, Optional[bytes]]:
        """How far another model key of this store (or the remote, in blocks of another size) holds the prompt,
        and that key (``None``: the remote's)."""
        if self.discovery is not None and self.discovery.remote.other_block_size(chain.root):
            return stop, None
        best, holder = 0, None
        for other in others[: reasons.OTHER_ROOTS]:
            got = self.table.lookup(other, KeyChain(other, chain.tokens, self.block_size), stop).length
            if got > best:
                best, holder = got, other
        return best, holder

    def _wait(self, pinned: Pinned, found: Found) -> int:
        """Wait for the puts still storing blocks of ``pinned`` (their rows not taken); returns the µs waited."""
        t0 = time.perf_counter()
        self.writer.wait(pinned.pending)
        self.table.view(pinned, found.blocks)  # where the waited-for blocks are now
        return int((time.perf_counter() - t0) * 1e6)

    def _account(self, pinned: Pinned, got, found: Found, plan, tail, cut: int, counts: dict[str, int],
                 t_load: float, why: dict[str, int], started: float) -> Hit:
        """Tell the table what was served (one lock) and the counters (one lock); the hit as the engine gets it."""
        now = time.time()
        touched = self.table.served(pinned, got.used, [p for p, r in zip(got.used, got.from_ram) if not r],
                                    got.on_device, now)
        self.reader.promote_later(touched.promote)
        if touched.demote:  # (copied back on the writer's thread, its own stream)
            self.writer.later(partial(self.table.device.copy_back, touched.demote))
        if got.length == 0:
            counts["misses"] = 1
            self.counters.record(counts, touched.disk_keys, now, not_served=why,
                                 seconds=time.perf_counter() - started)
            return Hit(skipped_tokens=counts["tokens_skipped_cost"], skip_reason=plan.reason, not_served=why)
        hit = self._hit(got, found, plan, tail, cut, counts["tokens_skipped_cost"])
        hit.not_served = why
        hit.source_bytes = self.planner.observe(got.used, got.nbytes, got.from_ram, min(got.length, cut), plan,
                                                t_load, counts)
        counts.update(hits=1, tokens_ram=hit.ram_tokens, tokens_ssd=hit.ssd_tokens, tokens_remote=hit.remote_tokens,
                      tokens_device=hit.device_tokens, tokens_queued=0 if tail is None else got.length - cut)
        self.counters.record(counts, touched.disk_keys, now, not_served=why, seconds=time.perf_counter() - started)
        if self.reuse is not None:  # asked for again: its chain may go to disk
            self.table.admissions.reused(got.used[-1])
            self.reuse()
        return hit

    @staticmethod
    def _hit(got, found: Found, plan, tail, cut: int, skipped: int) -> Hit:
        length = got.length
        spans = [(p, min(p.end, length) - p.start, r) for p, r in zip(got.used, got.from_ram)]
        remote = sum(m for p, m, _ in spans if p.key in found.blocks)
        ram = sum(m for p, m, r in spans if r and p.key not in found.blocks)
        ram += 0 if tail is None else length - cut  # (a queued put's rows count as RAM's)
        device = sum(m for (p, m, _), d in zip(spans, got.device) if d)
        return Hit(length, got.layers, ram_tokens=ram, ssd_tokens=length - ram - remote, skipped_tokens=skipped,
                   skip_reason=plan.reason, predicted_s=plan.load_s if length == plan.length else 0.0,
                   remote_tokens=remote, device_tokens=device)

    def _queued_hit(self, n: int, length: int, layers: list, why: dict[str, int], started: float) -> Hit:
        """A hit copied from a put the writer has not stored yet (``queued``)."""
        self.counters.record({"tokens_requested": n, "hits": 1, "tokens_ram": length, "tokens_queued": length},
                             not_served=why, seconds=time.perf_counter() - started)
        return Hit(length, layers, ram_tokens=length, not_served=why)
