"""One debug line per request: of the prompt's tokens, how many the store
served and from which tier, and why the rest were not (``Hit.not_served``).
Every server logs it after its fetch (``kvstore serve --log-level DEBUG``), so
an operator asking why a prompt missed reads the answer beside the request."""

from __future__ import annotations

import logging

from kvstore import Hit

__all__ = ["log_request", "request_line"]

log = logging.getLogger("kvstore")


def request_line(tokens: int, hit: Hit) -> str:
    """``kvstore: request 4,096 tokens: served 3,840 (ram 3,840); not served 256 (tail 200, new 55, limit 1)``:
    tiers apart (``device`` not counted in ``ram``), reasons largest first, zeros left out."""
    device = hit.device_tokens
    tiers = {"device": device, "ram": hit.ram_tokens - device, "ssd": hit.ssd_tokens, "remote": hit.remote_tokens}
    why = sorted(hit.not_served.items(), key=lambda kv: -kv[1])  # (stable: the core's order in ties)
    return (f"kvstore: request {tokens:,} tokens: served {hit.length:,}{_parts(tiers.items())}; "
            f"not served {sum(k for _, k in why):,}{_parts(why)}")


def _parts(counts) -> str:
    shown = ", ".join(f"{name} {k:,}" for name, k in counts if k)
    return f" ({shown})" if shown else ""


def log_request(tokens: int, hit: Hit) -> None:
    """Log ``request_line`` at DEBUG (formatted only when the level is on: a request pays nothing otherwise)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", request_line(tokens, hit))
