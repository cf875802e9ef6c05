"""A fetch that stops locally asks the remote tier for the rest of the chain.

Block keys are content addresses, so the keys of the prompt's next full
blocks are known without asking anyone (``KeyChain``). One pipelined round
trip reads their index records (small) and, for the block the prompt ends
inside, the stored children nearest to its tokens (``RemoteTier.probe``):
the child sharing the longest prefix with the prompt is one of them, whatever
came after it on the host that stored it. When the chain breaks earlier (the
prompt diverges from what is stored), one more round trip asks the same of
the block where it broke. The run of blocks whose records fit the prompt --
same root, parent, position and tokens -- and the best partial child are read
last (payloads, streamed: each block is handed over as it comes in, see
``tiers/resp``). Every payload is decoded as a local one is (header,
checksum, key binding) and its tokens compared again: a corrupt, foreign or
colliding value is refused and dropped from the server, never served. With
``remote_secret``, a block is served only if its MAC (checked on the reading
thread: ``RemoteTier.entries``) covers the record it was indexed by and its
payload; one without is skipped and counted (``remote_unauthenticated``) but
left on the server, which may be shared with stores of no or another secret
(this store's own copy, once computed, overwrites it).

What was read joins the index below where the walk stopped, goes into RAM
as far as it fits, and is handed to the read path as it is (the hit never
waits for a disk write); its LMDB copy is queued on the background writer
(as a job of already encoded blocks, so it is never copied back to the
remote).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import numpy as np

from ..blocks.wire import Stored
from ..config import StoreConfig
from ..counters import Counters
from ..errors import BlockDecodeError
from ..convert.gather import HostFill, start
from ..blocks.hashing import KeyChain, chain_key
from ..state.index import BlockRef
from ..state.lookup import shared_prefix
from ..blocks.record import BlockRecord, Entry
from ..tiers.remote.sync import Remote
from ..gpu.backend import Backend
from ..state.table import BlockTable

if TYPE_CHECKING:
    from .fetch import Match

log = logging.getLogger("kvstore")

Near = Optional[tuple[bytes, np.ndarray]]  # the block a prompt ends or diverges inside: its parent key, its tokens


class Found(NamedTuple):
    """Blocks a fetch found on the remote, by key, and the hit's arrays with
    them placed (``None``: ``gather`` places them); ``unreachable``: the
    remote was not asked (down) or did not answer."""

    blocks: dict = {}
    fill: Optional[HostFill] = None
    unreachable: bool = False


class Located(NamedTuple):
    """Where the remote's blocks of a prompt are (``Discovery._locate``): the run of its whole blocks found by
    key (records, up to block ``stop``), the probed records, the block the prompt ends or diverges inside
    (``near``) and the stored child sharing most with it, as ``(key, shared tokens, member)``."""

    stop: int
    run: list[BlockRecord]
    raw: list
    near: Near
    part: Optional[tuple[bytes, int, bytes]]


class Peeked(NamedTuple):
    """``Discovery.peek``: the records ``find`` would read, and the partial child's with the tokens it shares."""

    run: list[BlockRecord]
    part: Optional[tuple[BlockRecord, int]]


class Discovery:
    def __init__(self, remote: Remote, table: BlockTable, counters: Counters, config: StoreConfig,
                 keep_on_disk: bool, register: Callable[..., int], backend: Optional[Backend] = None):
        self.remote = remote
        self.register = register  # ``Writer.register_copies``: the writer owns the disk copies
        self.backend = backend
        self.table = table
        self.counters = counters
        self.max_probe = config.tuning.remote_probe_blocks
        self.keep_on_disk = keep_on_disk
        self._warned = False

    def find(self, root: bytes, chain: KeyChain, n: int, match: "Match", copies: list,
             quantized: Optional[tuple[int, int]] = None) -> Found:
        """Index the blocks of ``chain.tokens[:n]`` the remote holds beyond
        ``match``; returns them by key, checked, for the read path to serve
        (with the hit's arrays already filled with them where it can: see
        ``gather.start``), and adds to ``copies`` the writer's ids of their disk
        copies (for the caller to submit once the hit is served: they would
        only compete with it). Never raises; a down remote costs at most one
        timeout (then the breaker skips it)."""
        got = self._locate(root, chain, n, len(match.full.path))
        if got is None:
            return Found(unreachable=True)
        if not got.run and not got.part:
            return Found()
        got_blocks, fill = self._read_found(root, chain, n, got.stop, got.run, got.raw, got.near, got.part, quantized)
        if not got_blocks:
            return Found()
        self.counters.count("remote_blocks_read", len(got_blocks))
        self.counters.count("remote_bytes_read", sum(len(b) for _, _, b in got_blocks))
        return Found(self._keep(match.full.stop, got_blocks, chain, copies), fill)

    def peek(self, root: bytes, chain: KeyChain, n: int, match: "Match") -> Optional["Peeked"]:
        """What ``find`` would serve from the remote, read-only (``explain``): the records of the blocks it
        would read, payloads not read, nothing indexed, refused or counted; ``None`` when the remote could not
        be asked."""
        got = self._locate(root, chain, n, len(match.full.path), dry=True)
        if got is None:
            return None
        part = None
        if got.part is not None:  # its record (``find`` reads it with the payload)
            key, shared, _ = got.part
            probed = self.remote.probe(root, [key], None)  # (records, no children)
            raw = probed[0][0] if probed else None
            rec = BlockRecord.unpack(key, raw) if isinstance(raw, bytes) else None
            if rec is not None and not _mismatch(rec, root, got.near[0], got.stop * chain.block_size, None,
                                                 chain.tokens):
                part = (rec, shared)
        return Peeked(got.run, part)

    # ---------------------------------------------------------------- steps

    def _locate(self, root: bytes, chain: KeyChain, n: int, first: int, dry: bool = False) -> Optional[Located]:
        """The remote's blocks of ``chain.tokens[:n]`` from block ``first`` on, by their records (``Located``);
        ``None`` when the remote is down or did not answer. ``dry``: count nothing, refuse nothing."""
        bs = chain.block_size
        probed = self._probe(root, chain, n, first, count=not dry)
        if probed is None:
            return None
        last, raw, children, near = probed
        run = self._run(root, chain, first, raw, refuse=not dry)
        stop = first + len(run)  # the first block not found by key
        if stop < last:  # the prompt diverges inside block `stop`: its nearest stored sibling may share a prefix
            near = (chain.parent(stop), chain.tokens[stop * bs : min(n, (stop + 1) * bs)])
            children = self.remote.neighbours(root, *near)
        return Located(stop, run, raw, near, self._best_new_child(children, near))

    def _probe(self, root: bytes, chain: KeyChain, n: int, first: int, count: bool = True
               ) -> Optional[tuple[int, list, list, Near]]:
        """The first round trip: the records of the prompt's full blocks from ``first`` (at most ``max_probe``)
        and, where they reach the block the prompt ends inside, its stored children nearest the prompt (``near``:
        that block's parent key and tokens). Returns ``(end of the probed blocks, records, children, near)``;
        None when the remote is down (counted) or did not answer."""
        bs = chain.block_size
        full = n // bs
        last = min(full, first + self.max_probe)
        keys = [chain.key(i) for i in range(first, last)]
        near = (chain.parent(full), chain.tokens[full * bs : n]) if last == full and n > full * bs else None
        if not self.remote.available():
            if count:
                self.counters.count("remote_bypassed")
            return None
        got = self.remote.probe(root, keys, near)
        if got is None:
            return None
        if count:
            self.counters.count("remote_lookups")
        raw, children = got
        return last, raw, children, near

    def _best_new_child(self, children: list, near: Near) -> Optional[tuple[bytes, int, bytes]]:
        """The listed child this process does not hold that shares most with ``near``'s tokens, if any (a
        child held already is the local walk's business)."""
        if children:
            children = [c for c in children if c[0] not in self.table]
        return self._best_child(children, near[1]) if near is not None and children else None

    def _read_found(self, root: bytes, chain: KeyChain, n: int, stop: int, run: list[BlockRecord], raw: list,
                    near: Near, part: Optional[tuple[bytes, int, bytes]], quantized: Optional[tuple[int, int]]
                    ) -> tuple[list[tuple[BlockRecord, Stored, bytes]], Optional[HostFill]]:
        """The payloads of ``run`` (the full blocks before block ``stop``) and of the partial child ``part``
        read in one streamed round trip, each checked as it comes in (``_read``, ``_partial``): the good ones
        up to the first bad one, and the hit's arrays filled with them (or None)."""
        bs = chain.block_size
        wanted = [r.key for r in run] + ([part[0]] if part else [])
        sizes = [r.nbytes for r in run] + ([0] if part else [])
        got_blocks: list[tuple[BlockRecord, Stored, bytes]] = []
        rows = min(n, stop * bs + (part[1] if part else 0))  # the hit's length if all is good
        after, fill = self.remote.read(wanted, sizes, lambda entries: self._read(
            run, raw[: len(run)], entries, got_blocks, lambda first: start(first, rows, quantized, self.backend))) or (None, None)
        if part and len(got_blocks) == len(run) and after is not None:
            leaf = self._partial(root, chain, stop, n, near[0], part, after)
            if leaf is not None:
                got_blocks.append(leaf)
        return got_blocks, fill

    def _read(self, run: list[BlockRecord], packed: list[bytes], entries, got: list,
              start_fill: Callable[[Stored], Optional[HostFill]]) -> tuple[Optional[tuple], Optional[HostFill]]:
        """Check each block of ``run`` (``packed``: their records as probed) as
        it comes in (the next ones are read meanwhile) into ``got``, up to the
        first bad one, placing it in the hit's arrays (``start_fill(first
        block)``) as it is checked. Returns the entry read after the run (the
        partial child's), if any, and the fill."""
        fill = None
        i = 0
        for entry in entries:
            if i == len(run):
                return entry, fill
            if not self._authentic(run[i].key, entry, packed[i]):
                return None, fill
            block = self._open(run[i], entry[1])
            if block is not None and i == 0:
                fill = start_fill(block)
            if block is None or not self._intact(run[i], block, fill):
                return None, fill
            got.append((run[i], block, entry[1]))
            i += 1
        return None, fill

    def _run(self, root: bytes, chain: KeyChain, first: int, raw: list, refuse: bool = True) -> list[BlockRecord]:
        """The leading run of probed full blocks whose records fit the prompt (a record that does not is
        deleted from the server, where ``refuse``)."""
        bs = chain.block_size
        run = []
        for i, r in enumerate(raw, start=first):
            if r is None:
                break  # the chain stops here: no later block can be used
            key = chain.key(i)
            rec = BlockRecord.unpack(key, r) if isinstance(r, bytes) else None
            why = _mismatch(rec, root, chain.parent(i), i * bs, bs, chain.tokens) if rec is not None \
                else f"not a kvstore record ({r!r:.60})"
            if why:
                if refuse:
                    self._refuse(key, why)
                break
            run.append(rec)
        return run

    @staticmethod
    def _best_child(children: list, tokens: np.ndarray) -> Optional[tuple[bytes, int, bytes]]:
        """``(key, shared tokens, member)`` of the listed child sharing most with ``tokens``."""
        best = None
        for key, toks, member in children:
            shared = shared_prefix(toks, tokens)
            if shared and (best is None or shared > best[1]):
                best = (key, shared, member)
        return best

    def _partial(self, root: bytes, chain: KeyChain, i: int, n: int, parent: bytes, part: tuple,
                 entry: tuple) -> Optional[tuple[BlockRecord, Stored, bytes]]:
        """The best partial child read back and checked: its record must be
        the child of ``parent`` at block ``i`` and share tokens with the prompt."""
        key, _, member = part
        raw, buf, _ = entry
        if raw is None:
            self.remote.forget_child(root, parent, member)  # evicted: a stale listing
            return None
        if not self._authentic(key, entry):
            return None
        rec = BlockRecord.unpack(key, raw) if isinstance(raw, bytes) else None
        bs = chain.block_size
        why = "unreadable index record" if rec is None else _mismatch(rec, root, parent, i * bs, None,
                                                                      chain.tokens)
        if why:
            self._refuse(key, why)
            return None
        block = self._open(rec, buf)
        return None if block is None or not self._intact(rec, block, None) else (rec, block, buf)

    def _open(self, rec: BlockRecord, buf) -> Optional[Stored]:
        """``buf`` as the block of ``rec`` (header and tokens checked)."""
        if buf is None:
            return None  # evicted by the server since its record was read
        if not isinstance(buf, (bytes, memoryview)):
            self._refuse(rec.key, f"not a kvstore block ({buf})")
            return None
        try:
            block = Stored.of(buf, rec.key, rec.start)
        except BlockDecodeError as e:
            self._refuse(rec.key, str(e))
            return None
        if not np.array_equal(block.tokens, rec.tokens):
            self._refuse(rec.key, "payload tokens differ from its record")
            return None
        return block

    def _intact(self, rec: BlockRecord, block: Stored, fill: Optional[HostFill]) -> bool:
        """Whether ``block``'s payload passes its checksum, taken as it is
        placed in ``fill`` where it fits there (one pass over the bytes)."""
        if not (fill is not None and fill.place(block, rec.start)) and not block.intact():
            self._refuse(rec.key, "payload checksum mismatch")
            return False
        block.checked = True
        return True

    def _authentic(self, key: bytes, entry: tuple, probed: Optional[bytes] = None) -> bool:
        """Whether ``entry`` may be served under the store's secret (always without one): its MAC checks out,
        over the record the block was indexed by (``probed``, when that was read before the payload)."""
        raw, payload, ok = entry
        if ok is None or payload is None:  # no secret; or evicted since probed (``_open`` stops there)
            return True
        if ok and (probed is None or raw == probed):
            return True
        self.counters.count("remote_unauthenticated")
        (log.debug if self._warned else log.warning)(
            "kvstore: remote block %s skipped: no valid MAC under this store's remote_secret (written by a store "
            "without it or with another; see stats()['remote_unauthenticated'])", key.hex()[:16])
        self._warned = True
        return False

    def _refuse(self, key: bytes, why: str) -> None:
        self.counters.count("remote_bad")
        log.warning("kvstore: remote block %s refused: %s; it is deleted from %s", key.hex()[:16], why,
                    self.remote.url)
        self.remote.remove([key])

    def _keep(self, parent: BlockRef, got: list[tuple[BlockRecord, Stored, bytes]], chain: KeyChain,
              copies: list[int]) -> dict[bytes, Stored]:
        """Index ``got`` below ``parent``, into RAM as far as it fits; a job
        for the disk copy of the new blocks is registered with the writer and its id goes to ``copies``."""
        now = time.time()

        def pending(fresh: list[BlockRef]) -> int:
            new = {nd.key for nd in fresh}
            # the remote's bytes are LMDB's bytes: no second serialization
            entries = {r.key: Entry(replace(r, nbytes=len(buf), created=now, used=now, hits=0), memoryview(buf))
                       for r, _, buf in got if r.key in new}
            copies.append(self.register(fresh, chain.root, chain.tokens, entries))
            return copies[-1]

        fresh = self.table.keep_found(parent, [(r, block) for r, block, _ in got], now,
                                      pending if self.keep_on_disk else None)
        new = {nd.key for nd in fresh}
        return {r.key: block for r, block, _ in got if r.key in new}


def _mismatch(rec: BlockRecord, root: bytes, parent: bytes, start: int, length: Optional[int],
              tokens: np.ndarray) -> Optional[str]:
    """Why a remote record cannot be the prompt's block at ``start``, or
    ``None``. ``length=None``: a partial match (the stored block may go on
    where the prompt does not, but must share its first tokens)."""
    if rec.root != root or rec.parent != parent:
        return "record of another chain"
    if rec.start != start:
        return f"record at token {rec.start}, expected {start}"
    if length is None:
        if chain_key(parent, rec.tokens) != rec.key:
            return "record tokens do not hash to its key"
        return None if shared_prefix(rec.tokens, tokens[start : start + rec.length]) else "shares no token"
    if rec.length != length:
        return f"record of {rec.length} tokens, expected {length}"
    if not np.array_equal(rec.tokens, tokens[start : start + length]):
        return "tokens differ from the prompt (hash collision?)"
    return None
