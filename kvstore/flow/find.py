"""Which stored blocks a prompt's lookup finds: the index walked, the disk
asked (outside the table's lock) where the index ends, and the best block the
prompt ends or diverges inside of."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..blocks.hashing import KeyChain
from ..state import lookup
from ..state.index import BlockRef
from ..state.table import BlockTable
from .disk import Disk


def find(table: BlockTable, disk: Optional[Disk], tokens_of: Callable[[BlockRef], Optional[np.ndarray]],
         root: bytes, chain: KeyChain, n: int) -> lookup.Match:
    """The stored blocks along ``chain.tokens[:n]``, looking on disk (outside
    the table's lock) for blocks other processes wrote where the index
    ends, and for one block the prompt ends or diverges inside of."""
    looked: set[bytes] = set()
    while True:
        full = table.walk(root, chain, n)
        stop = full.last
        if (disk is None or stop.key in looked or full.length >= n
                or not (stop.is_root or stop.on_disk)):
            break
        # partial blocks other processes wrote below the stop are found only on disk, even where
        # this process has children of its own there
        looked.add(stop.key)
        disk.discover(stop)
    match = lookup.Match(full, list(full.nodes), full.length)
    if full.length < n:
        candidates = table.candidates(stop, chain, full.length, n)
        best, shared = lookup.best_partial(candidates, chain, full.length, n, tokens_of)
        if best is not None:
            match.path.append(best)
            match.matched += shared
    return match
