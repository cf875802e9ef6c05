"""Which stored blocks serve a prompt, and at which lengths.

Pure functions over the index: no tier is read here. The
servability rule has two halves that must agree:

- ``block_gap`` (at ``put``): which rows a block lacks, when a sliding-window
  layer kept only its last rows;
- ``restorable`` (at ``fetch``): whether every layer can be rebuilt at a given
  length from the blocks on the path.

Callers hold the table's lock (``shared_prefix`` needs none: the fetch
compares tokens it read from disk with it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..blocks.hashing import KeyChain
from .index import FULL_GAP, NO_GAP, Walk, Node, RadixIndex
from ..blocks.layers import KVLayer


def walk(index: RadixIndex, root: Node, chain: KeyChain, n: int) -> Walk:
    """Whole blocks of ``chain.tokens[:n]`` found by key (every whole block's key made in one go: a miss
    hashes the prompt's blocks as a put of it would, at GB/s)."""
    return index.match(root, chain.first(n // chain.block_size))


def partial_candidates(node: Node, chain: KeyChain, pos: int, n: int) -> list[Node]:
    """Children of ``node`` that may share tokens with the prompt at ``pos``:
    those starting with its token there."""
    if pos >= n or not node.children:
        return []
    first = int(chain.tokens[pos])
    return [c for c in node.children.values() if c.first == first]


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


# ------------------------------------------------------------ servability


def block_gap(late: Sequence[KVLayer], start: int, end: int) -> tuple[int, int]:
    """(``gap``, ``rows_from``) of block ``[start, end)`` given the layers whose
    rows start after token 0 (see ``index.Node``)."""
    gap, rows_from = NO_GAP, start
    for l in late:
        if l.start > start:
            if l.window is None:
                return FULL_GAP, end
            gap, rows_from = max(gap, l.window), max(rows_from, min(l.start, end))
    return gap, rows_from


def restorable(path: Sequence[Node], length: int) -> bool:
    """Whether every layer can be rebuilt at ``length`` from ``path``:
    recurrent state only where a snapshot was taken, sliding-window layers only
    where their window's rows are all there."""
    for p in path:
        if p.start >= length:
            break
        if p.gap == FULL_GAP:
            return False
        if p.gap > 0 and p.end > length - p.gap and max(p.start, length - p.gap) < p.rows_from:
            return False  # a sliding window reaches rows this block lacks
        if p.snap is not None and p.end == length and not p.snap:
            return False
    last = next(p for p in reversed(path) if p.start < length)
    return last.snap is None or (last.end == length and last.snap)


def servable(path: Sequence[Node], matched: int) -> int:
    """Longest length <= ``matched`` along ``path`` that ``restorable`` allows."""
    if not path:
        return 0
    stateful = any(p.snap is not None for p in path)
    ends = {p.end for p in path if p.end <= matched}
    if not stateful:
        ends.add(matched)  # the last block may be used partially: KV trims
    for length in sorted(ends, reverse=True):
        if length and restorable(path, length):
            return length
    return 0


# ------------------------------------------------------------------ put


def new_blocks(index: RadixIndex, root: Node, chain: KeyChain, n: int, has_state: bool,
               late: Sequence[KVLayer]) -> list[Node]:
    """Index the blocks of ``chain.tokens[:n]`` the store lacks and return
    them (a block stored without the state snapshot this put carries is
    returned too, to be re-encoded in place)."""
    bs = chain.block_size
    new: list[Node] = []
    node = root
    keys = chain.first(n // bs)
    firsts = chain.tokens[0:n:bs].tolist()
    i, count = 0, (n + bs - 1) // bs
    while i < count:
        start = i * bs
        if i < len(keys):
            length, key = bs, keys[i]
        else:
            length = n - start
            key = chain.tail_key(i, length)
        child = node.children.get(key) if node.children else None
        if child is None and i < len(keys) and not has_state and not late:
            # the whole blocks from here on are new and alike: one pass (a long put's hot loop)
            new += index.add_run(node, keys[i:], start, bs, firsts[i : len(keys)])
            node, i = new[-1], len(keys)
            continue
        i += 1
        end_here = start + length == n
        if child is not None and not (end_here and has_state and child.snap is False):
            node = child
            continue
        gap, rows_from = block_gap(late, start, start + length) if late else (NO_GAP, start)
        if gap == FULL_GAP:
            break
        if child is not None:
            # The blocks below it stay (dropping them would lose other prompts' prefixes), and a job
            # still encoding it leaves it to this one.
            child.snap, child.gap, child.rows_from = True, gap, rows_from
            node = child
        else:
            node = index.add(node, key, start, length, firsts[i - 1],
                             end_here if has_state else None, gap, rows_from)
        new.append(node)
    return new
