"""Why a fetch served no more: a reason for every prompt token it did not serve.

A fetch narrows the prompt in steps, each with its own reason, so the
tokens past what was served split into consecutive spans:

    [0, served)               served
    [served, planned)         a block failed as it was read: ``corrupt`` (its checks), ``evicted`` (another
                              process removed it) or ``unavailable`` (the disk read failed)
    [planned, servable)       ``declined``: the cost model chose recomputing
    [servable, matched)       ``no_snapshot``: a hybrid or windowed model has no state stored there
    [matched, limit)          no stored block covers them (``unmatched``, per block, below)
    [limit, len(prompt))      ``limit``: the caller asked for no more

Past the match, a block the prompt ends or departs inside of (not whole, or
only partly stored) is ``tail``; each whole block is ``evicted`` /
``corrupt`` / ``skipped`` where this process dropped it (``Gone``),
``other_model`` where another model key of this store holds the same
tokens (or the remote holds this model in blocks of another size),
``unavailable`` where the remote tier holding more could not be asked,
else ``new``. Finding them costs only the part not served.
"""

from __future__ import annotations

from typing import Optional

from ..hit import REASONS

__all__ = ["REASONS", "add", "spans", "unmatched", "whole_blocks"]
OTHER_ROOTS = 16  # other models asked whether they hold a missed prompt (a store of many models asks the first 16)


def add(why: dict[str, int], reason: str, tokens: int) -> None:
    if tokens > 0:
        why[reason] = why.get(reason, 0) + tokens


def spans(served: int, planned: int, servable: int, matched: int, limit: int, total: int, short: str
          ) -> tuple[dict[str, int], int, int]:
    """The reasons of the tokens ``[served, matched)`` and ``[limit, total)``; returns them with the span
    ``[start, stop)`` left to ``unmatched`` (bounds made monotone: the reasons always sum to
    ``total - served``)."""
    why: dict[str, int] = {}
    a = max(served, planned)
    b = max(a, servable)
    c = max(b, matched)
    d = max(c, limit)
    add(why, short or "unavailable", a - served)
    add(why, "declined", b - a)
    add(why, "no_snapshot", c - b)
    add(why, "limit", total - d)
    return why, c, d


def whole_blocks(start: int, stop: int, block_size: int) -> range:
    """The whole blocks inside ``[start, stop)``; the tokens around them are ``tail``."""
    return range(-(-start // block_size), stop // block_size)


def unmatched(why: dict[str, int], start: int, stop: int, block_size: int, known: list[Optional[str]],
              elsewhere: int, unreachable: bool) -> None:
    """Add the reasons of ``[start, stop)``, which no stored block covers: ``known``, per whole block (see
    ``whole_blocks``), why this process dropped it (``None``: not known); ``elsewhere``: the token up to which
    another model key holds the prompt's blocks; ``unreachable``: the remote could not be asked."""
    blocks = whole_blocks(start, stop, block_size)
    if not blocks:
        add(why, "tail", stop - start)
        return
    add(why, "tail", blocks.start * block_size - start)
    add(why, "tail", stop - blocks.stop * block_size)
    for i, reason in zip(blocks, known):
        if reason is None:
            if (i + 1) * block_size <= elsewhere:
                reason = "other_model"
            else:
                reason = "unavailable" if unreachable else "new"
        add(why, reason, block_size)
