"""The device backend arrays live on, chosen in one place (``choose``).

What copies and lands a block's arrays asks one thing of the machine:
whether mlx's arrays live in memory apart from the host's (CUDA: blocks are
laid out on the GPU and downloaded once, hits land on the copy engine,
there is a device tier), or in memory the host shares (a CPU; Apple
silicon's unified memory, where Metal reads what the host wrote: the host
paths, and the RAM tier is the device tier). ``cuda.runtime()`` is asked
here and in ``kvstore.gpu`` alone. A store chooses once, when it opens, and
hands its ``Backend`` to what copies and lands arrays (reader, writer,
discovery, planner, warm-up); a function called without one takes
``choose()``'s at that call (a test that installs a runtime with
``monkeypatch.setattr(cuda, "runtime", ...)`` before opening a store, or
before calling such a function, switches it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from . import cuda


@dataclass(frozen=True)
class Backend:
    """Where a store's arrays live: ``name`` ("cuda", "metal" or "cpu") and,
    on CUDA, the runtime whose copy engine moves bytes to and from them."""

    name: str
    runtime: Optional[cuda.Runtime] = None
    # arrays live in device memory apart from the host's (CUDA): bytes cross on the copy engine, never through
    # a host array's address (a field, set from ``runtime``: every gather asks it)
    apart: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "apart", self.runtime is not None)

    def device_memory(self) -> int:
        """Bytes of the device's own memory (0 where memory is one: a CPU, Apple silicon)."""
        return 0 if self.runtime is None else self.runtime.total_memory()


_last: Optional[Backend] = None  # the backend chosen last, handed out again while its runtime is the same
_host: Optional[Backend] = None  # the host backend of this machine (its name asked of mlx once)


def choose() -> Backend:
    """The backend this process runs on now: CUDA where ``cuda.runtime()``
    finds mlx's runtime, else the host's memory (Metal's unified memory
    takes the CPU's paths)."""
    global _last, _host
    rt = cuda.runtime()
    last = _last
    if last is not None and last.runtime is rt:
        return last
    if rt is not None:
        chosen = Backend("cuda", rt)
    else:
        if _host is None:
            _host = Backend("metal" if _metal() else "cpu")
        chosen = _host
    _last = chosen
    return chosen


def _metal() -> bool:
    try:
        return bool(mx.metal.is_available())
    except AttributeError:  # (an mlx built without Metal)
        return False
