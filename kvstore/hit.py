"""``Hit``: what a fetch found, as the engine gets it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .blocks.layers import Layer


@dataclass
class Hit:
    """What ``fetch`` found: ``length`` prompt tokens whose KV is in ``layers``."""

    length: int = 0
    layers: Optional[list[Layer]] = None
    ram_tokens: int = 0  # of ``length``, tokens whose blocks came from RAM
    ssd_tokens: int = 0  # ... and from the LMDB tier
    skipped_tokens: int = 0  # stored tokens not served because recomputing them is faster
    skip_reason: str = ""
    predicted_s: float = 0.0  # what the cost model expected loading ``length`` to take
    remote_tokens: int = 0  # of ``length``, tokens whose blocks this fetch read from the remote tier
    source_bytes: dict = field(default_factory=dict)  # bytes served per source (``cost.STATES``)

    def __bool__(self) -> bool:
        return self.length > 0
