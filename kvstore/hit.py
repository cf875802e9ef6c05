"""``Hit``: what a fetch found, as the engine gets it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .blocks.layers import Layer

# Why prompt tokens were not served (``Hit.not_served``; kvstore/flow/reasons.py says when each applies).
REASONS = ("new", "evicted", "skipped", "declined", "tail", "other_model", "no_snapshot", "unavailable", "corrupt",
           "limit")


@dataclass
class Hit:
    """What ``fetch`` found: ``length`` prompt tokens whose KV is in ``layers``; ``not_served``: the
    prompt's other tokens by the reason they were not served (``REASONS``; they sum to the rest)."""

    length: int = 0
    layers: Optional[list[Layer]] = None
    ram_tokens: int = 0  # of ``length``, tokens whose blocks came from RAM
    ssd_tokens: int = 0  # ... and from the LMDB tier
    skipped_tokens: int = 0  # stored tokens not served because recomputing them is faster
    skip_reason: str = ""
    predicted_s: float = 0.0  # what the cost model expected loading ``length`` to take
    remote_tokens: int = 0  # of ``length``, tokens whose blocks this fetch read from the remote tier
    source_bytes: dict = field(default_factory=dict)  # bytes served per source (``cost.STATES``)
    not_served: dict[str, int] = field(default_factory=dict)  # reason -> tokens (only reasons that apply)
    device_tokens: int = 0  # of ``ram_tokens``, tokens whose blocks were served from device copies

    def __bool__(self) -> bool:
        return self.length > 0
