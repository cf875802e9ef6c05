"""A fetch of a prompt whose put the writer has not stored yet, served from
that put's own arrays.

A conversation's next request usually shares the prompt and answer just put:
on a GPU under a live replay, fetches waited a third to a half of their time
for the writer to encode such blocks (docs/benchmarks.md, live replay). The
put's job still holds the engine's arrays (the writer lets go of them once
encoded), so the rows the fetch needs are there: they are put through the
store's codec on the engine's side (quantized and back, row by row as the
writer does it, so the same bits a read of the stored blocks gives) instead
of waited for. A store's hits never depend on how far its writer has got.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..blocks.codec import Codec, densify
from ..blocks.layers import KVLayer, Layer, Quantized, own, take_rows


def rows_of_queued(jobs: Sequence, tokens: np.ndarray, start: int, length: int, codec: Codec
                   ) -> Optional[list[Layer]]:
    """Rows ``[start, length)`` of every layer, as a read of them once stored
    under ``codec`` gives them, made from a queued put whose prompt starts
    with ``tokens[:length]`` and whose layers are plain attention held from
    row 0 (dense, not sliding windows, no state); None when no such put is
    still holding its arrays. (Rows before ``start`` are stored already,
    maybe under other settings: those are read as stored.) Not evaluated:
    plain rows are views of the put's arrays until ``owned`` or ``joined``
    copies them, once."""
    for job in jobs:
        layers = job.layers  # (read once: the writer empties it once the job is encoded)
        if not layers or job.found is not None or len(job.tokens) < length \
                or not np.array_equal(job.tokens[:length], tokens[:length]):
            continue
        if plain(layers) and all(l.stop >= length and not isinstance(l.keys, Quantized)
                                 and not isinstance(l.values, Quantized) for l in layers):
            return [KVLayer(densify(codec.compress_keys(take_rows(l.keys, start, length))),
                            densify(codec.compress_values(take_rows(l.values, start, length))), start)
                    for l in layers]
    return None


def plain(layers: Sequence[Layer]) -> bool:
    """Attention rows from the first token on, no window, no state: what a longer prompt's arrays hold too."""
    return all(isinstance(l, KVLayer) and l.start == 0 and l.window is None for l in layers)


def owned(rows: list[Layer]) -> list[Layer]:
    """A queued put's rows as arrays of their own (a view would keep the engine's whole buffer alive and see its
    in-place writes)."""
    return _evaluated([KVLayer(own(l.keys), own(l.values)) for l in rows])


def joined(head: list[Layer], tail: list[Layer]) -> list[Layer]:
    """Rows read from the store, then a queued put's rows after them, one array per layer and tensor."""
    return _evaluated([KVLayer(mx.concatenate([a.keys, b.keys], axis=2), mx.concatenate([a.values, b.values], axis=2))
                       for a, b in zip(head, tail)])


def _evaluated(layers: list[Layer]) -> list[Layer]:
    mx.eval([x for l in layers for x in (l.keys, l.values)])
    return layers
