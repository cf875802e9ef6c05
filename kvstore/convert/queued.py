"""A fetch of a prompt whose put the writer has not stored yet, served from
that put's own arrays.

A conversation's next request usually shares the prompt and answer just put:
on a GPU under a live replay, fetches waited a third to a half of their time
for the writer to encode such blocks (docs/benchmarks.md, live replay). The
put's job still holds the engine's arrays (the writer lets go of them once
encoded), so the rows the fetch needs are there, exact, with nothing to
decode: they are copied out on the device instead of waited for. Only for a
store that keeps rows as given (no quantization), where those rows are
exactly what the fetch would read back once stored: a quantized store's
hits must not depend on how far its writer has got.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..blocks.layers import KVLayer, Layer, Quantized, own, take_rows


def rows_of_queued(jobs: Sequence, tokens: np.ndarray, length: int) -> Optional[list[Layer]]:
    """Rows ``[0, length)`` of every layer, copied from a queued put whose
    prompt starts with ``tokens[:length]`` and whose layers are plain
    attention held from row 0 (dense, not sliding windows, no state); None
    when no such put is still holding its arrays."""
    for job in jobs:
        layers = job.layers  # (read once: the writer empties it once the job is encoded)
        if not layers or job.found is not None or len(job.tokens) < length \
                or not np.array_equal(job.tokens[:length], tokens[:length]):
            continue
        if all(isinstance(l, KVLayer) and l.start == 0 and l.window is None and l.stop >= length
               and not isinstance(l.keys, Quantized) and not isinstance(l.values, Quantized) for l in layers):
            out: list[Layer] = [KVLayer(own(take_rows(l.keys, 0, length)), own(take_rows(l.values, 0, length)))
                                for l in layers]
            mx.eval([a for l in out for a in (l.keys, l.values)])
            return out
    return None
