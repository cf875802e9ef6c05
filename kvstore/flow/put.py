"""A put's work on the engine's thread: the input checked and captured, the
blocks the table lacks hashed and indexed, and their writer job built (queued
by the store)."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..blocks.codec import layer_arrays
from ..blocks.hashing import KeyChain, as_tokens, root_key
from ..blocks.layers import WARM_LAYERS, KVLayer, Layer, StateLayer, captured_layers
from ..counters import Counters
from ..state.table import BlockTable


def index_put(table: BlockTable, root_of: Callable[[], bytes], tokens, layers: Sequence[Layer],
              block_size: int, register: Callable[..., int]) -> tuple[int, int]:
    """A put's work on the engine's thread but queueing it: the input checked
    and captured, the blocks ``table`` lacks hashed and indexed, and their
    put registered (``Writer.register_put``: the writer owns it from then on).
    Returns the token count and the put's id (0 when nothing is new)."""
    toks = as_tokens(tokens)
    n = len(toks)
    layers = captured_layers(layers, n)  # the values of now, whatever the caller changes later
    if n == 0:
        return 0, 0
    # Evaluate here: mlx streams are per thread, so the background thread cannot evaluate a lazy graph
    # built on the caller's (a no-op when the engine evaluated its cache, as it does after every step).
    # The second call marks each array's record available, here: mlx does that the first time it finds the
    # computation done, from whichever thread asks, and the writer may hold the engine's own records (the
    # engine's buffers, passed with ``rows``), whose status the engine's next step reads and writes.
    arrays = [a for l in layers for a in layer_arrays(l)]
    mx.eval(arrays)
    mx.eval(arrays)
    has_state = any(isinstance(l, StateLayer) for l in layers)
    late = [l for l in layers if isinstance(l, KVLayer) and l.start > 0]  # layers lacking early rows
    root = root_of()  # (the model's root key)
    chain = KeyChain(root, toks, block_size)
    return n, table.plan_put(root, chain, n, has_state, late,
                             lambda count: register(count, root, toks, layers, sum(a.nbytes for a in arrays)))


def warm_put(block_size: int) -> None:
    """``index_put`` once, at open, into a throwaway table: otherwise the
    engine's first put pays for Python's first pass over it, about twice its
    later ones (docs/benchmarks.md, put)."""
    table = BlockTable(0, Counters(), has_disk=False, writable=True)
    n = 2 * block_size + 1
    a = mx.zeros((1, 1, n + 1, 8), mx.float16)
    index_put(table, lambda: root_key("warm"), np.arange(n, dtype=np.int32),
              [KVLayer(a, a, rows=n)] * WARM_LAYERS, block_size, lambda *job: 1)
