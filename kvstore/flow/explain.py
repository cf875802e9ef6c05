"""Why a prompt would miss: a dry run of the fetch for one prompt, block by
block (``PrefixStore.explain``, ``kvstore explain``).

It takes the fetch's own steps and stops before the read: ``FetchPath.match``
(the local tiers, with the blocks other processes wrote on disk); the remote,
for the blocks past that, asked for their records only (``Discovery.peek``);
``BlockTable.pin``, released at once, for where each block is; the same
``Planner.plan``; and the reasons from the fetch's own function
(``FetchPath.not_served``), with served = what the plan would load. Per block
the same reasons are taken over the block's tokens alone (``reasons.spans``
and ``reasons.unmatched`` are sums over positions), so the blocks add up to
the totals.

It loads nothing and changes nothing: no payload is read, no block indexed
from the remote, promoted, touched in an LRU or counted (a remote that fails
the probe trips the breaker, as any call does). What it cannot see without a
read: a block whose bytes went bad on disk shows as on disk until a fetch
reads it (from then on, in that process, it reads ``corrupt``); a put still
being stored (``queued``) is planned as the fetch would take its rows, not
waited for. Beside running engines (``readonly=True``, another process), it
sees the disk and the remote: their RAM and device copies are their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple, Optional

from ..blocks.hashing import KeyChain
from ..blocks.ondevice import DeviceBlock
from ..blocks.record import BlockRecord
from ..cost.model import Plan
from ..state.index import BlockRef
from ..state.plans import Pinned
from . import reasons
from .discovery import Peeked
from .fetch import FetchPath, Match, Narrowed, Unstored


@dataclass
class BlockWhy:
    """One block of the prompt: tokens ``[start, end)``, where the store holds it (``device``, ``ram``, ``disk``,
    ``remote``, ``nowhere``, or ``queued``: a put still being stored), how many of its tokens a fetch would serve
    and why the rest would not be (reason -> tokens); ``loads_from``: the cost model's view of a servable block
    (``ram``, ``ssd_cached``, ``ssd_cold``); ``held_by``: for ``other_model``, the model of this store that holds
    these tokens."""

    index: int
    start: int
    end: int
    where: str
    served: int = 0
    not_served: dict[str, int] = field(default_factory=dict)
    loads_from: str = ""
    held_by: Optional[str] = None


@dataclass
class Verdict:
    """What the cost model would choose (``Plan``): load ``length`` of the ``servable`` tokens, predicted to
    take ``load_s`` and the prefill of the rest ``prefill_s``, against ``recompute_s`` for prefilling the
    whole prompt (``None``: this model's prefill is not measured yet); ``reason`` where it serves less."""

    policy: str
    servable: int
    length: int
    load_s: float = 0.0
    prefill_s: float = 0.0
    recompute_s: Optional[float] = None
    reason: str = ""


@dataclass
class Explanation:
    """``PrefixStore.explain``: ``served`` of the prompt's ``tokens`` (at most ``limit``) a fetch would serve,
    the rest by reason (``not_served``: what ``Hit.not_served`` would say), the cost model's ``verdict`` and
    every block (``blocks``: their served and not-served tokens add up to those). ``tiers``: the tiers this
    process sees."""

    model: str
    tokens: int
    limit: int
    block_size: int
    tiers: list[str]
    served: int
    not_served: dict[str, int]
    verdict: Verdict
    blocks: list[BlockWhy]

    def to_dict(self) -> dict:
        return asdict(self)


class _Held(NamedTuple):
    """A remote block in the pin's eyes: found, in hand at its size (``BlockTable.pin``'s ``found``)."""

    nbytes: int


def explain(fp: FetchPath, chain: KeyChain, n: int, *, model: str, tiers: list[str],
            name_of: Callable[[bytes], str]) -> Explanation:
    """The dry run of ``fp.fetch(chain.root, chain.tokens, n)`` (see the module docstring); ``name_of`` names
    another model's root key."""
    root, total = chain.root, len(chain.tokens)
    match = fp.match(root, chain, n)
    peeked, unreachable = None, False
    if fp.discovery is not None and match.matched < n:
        peeked = fp.discovery.peek(root, chain, n, match)
        unreachable = peeked is None
    path, matched, remote = _with_remote(match, peeked, chain)
    pinned = fp.table.pin(path, matched, remote)
    fp.table.release(pinned)  # nothing is read: where each block is now is all it asks
    plan, served = _plan(fp, root, total, pinned, remote)
    at = Narrowed(served, plan.length, pinned.length, matched, n)
    why = fp.not_served(chain, at, unreachable)
    _, start, stop = reasons.spans(*at, total, "")
    un = fp.unstored(chain, start, stop)
    held = None if un.holder is None and not un.elsewhere else name_of(un.holder) if un.holder else "the remote"
    blocks = _blocks(fp.block_size, total, at, un, reasons.whole_blocks(start, stop, fp.block_size), unreachable)
    _where(blocks, path, pinned, remote, plan, fp.block_size)
    for b in blocks:
        if "other_model" in b.not_served:
            b.held_by = held
    pm = fp.planner.cost.prefill_model(root.hex())
    verdict = Verdict(fp.planner.cost.policy, pinned.length, plan.length, plan.load_s, plan.prefill_s,
                      None if pm is None else pm.seconds(0, total), plan.reason)
    return Explanation(model, total, n, fp.block_size, tiers, served, why, verdict, blocks)


def _with_remote(match: Match, peeked: Optional[Peeked], chain: KeyChain
                 ) -> tuple[list[BlockRef], int, dict[bytes, _Held]]:
    """The path and matched length the fetch would have after indexing what the remote holds (``peeked``), and
    those remote blocks (as refs of no indexed block: the table leaves them out of its pins)."""
    if peeked is None or not (peeked.run or peeked.part):
        return match.path, match.matched, {}
    bs, first = chain.block_size, len(match.full.path)
    recs = list(peeked.run)
    path = list(match.full.path) + [_ref(r) for r in recs]
    matched = (first + len(recs)) * bs
    local = match.matched - first * bs if not recs and len(match.path) > first else 0  # a local partial block
    if peeked.part is not None and peeked.part[1] > local:  # (the re-match takes the one sharing more)
        recs.append(peeked.part[0])
        path.append(_ref(peeked.part[0]))
        matched += peeked.part[1]
    elif local:
        path.append(match.path[-1])
        matched += local
    return path, matched, {r.key: _Held(r.nbytes) for r in recs}


def _ref(rec: BlockRecord) -> BlockRef:
    """A remote block as a ref (of no indexed block: ident 0) with what servability and costing read."""
    return BlockRef(rec.key, rec.parent, rec.start, rec.length, rec.first, rec.snap, rec.gap,
                    rec.first_row if rec.gap else rec.start, 0, nbytes=rec.nbytes, end=rec.end)


def _plan(fp: FetchPath, root: bytes, total: int, pinned: Pinned, remote: dict) -> tuple[Plan, int]:
    """The fetch's plan and what it would serve. A put still storing blocks of the path hands over its rows
    from ``queued_from`` on, at no cost (``FetchPath._serve``); from the first block, with no plan."""
    queued = bool(pinned.pending) and fp.from_queued and not remote
    if queued and pinned.queued_from == 0:
        return Plan(pinned.length, pinned.length, reason="rows of a put still being stored: no plan made"), \
            pinned.length
    cut = pinned.queued_from if queued else pinned.length
    plan = fp.planner.plan(root, total, pinned, remote, frozenset(p.key for p in pinned.path if p.start >= cut))
    return plan, pinned.length if queued and plan.length > cut else plan.length


def _blocks(bs: int, total: int, at: Narrowed, un: Unstored, unmatched: range, unreachable: bool
            ) -> list[BlockWhy]:
    """Each block's served tokens and reasons: ``reasons.spans`` and ``reasons.unmatched`` over its tokens alone
    (the bounds clipped to it; ``unmatched``: the whole blocks ``un`` speaks of)."""
    out = []
    for i in range(-(-total // bs)):
        s, e = i * bs, min(total, (i + 1) * bs)
        clip = [min(max(x, s), e) for x in at]
        why, start, stop = reasons.spans(*clip, e, "")
        known = [un.known[i - unmatched.start]] if i in unmatched else []
        reasons.unmatched(why, start, stop, bs, known, un.elsewhere, unreachable)
        out.append(BlockWhy(i, s, e, "nowhere", clip[0] - s, why))
    return out


def _where(blocks: list[BlockWhy], path: list[BlockRef], pinned: Pinned, remote: dict, plan: Plan,
           bs: int) -> None:
    """Where each block of ``path`` is (the pin's look for those it holds, the walk's for the rest)."""
    items = dict(zip((p.key for p in pinned.path), pinned.items))
    for p in path:
        if p.start // bs >= len(blocks):
            continue
        b, item = blocks[p.start // bs], items.get(p.key)
        if p.key in remote:
            b.where = "remote"
        elif isinstance(item, DeviceBlock):
            b.where = "device"
        elif item is not None or p.in_ram:
            b.where = "ram"
        else:
            b.where = "disk" if p.on_disk else "queued"
        b.loads_from = plan.states.get(p.key, "")
