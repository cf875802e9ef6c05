"""Keyed MACs of remote blocks (``remote_secret``).

With a secret, every block a store writes to the remote tier carries an
HMAC-SHA256 tag (field ``a``) over its block key, packed record and payload,
each length-prefixed so no bytes can move from one field to another; a store
with a secret serves only blocks whose tag it can verify. A Redis client
without the secret (one holding the server's password is enough to write)
thus cannot make blocks that such engines serve. HMAC-SHA256 rather than
keyed BLAKE2b: OpenSSL's SHA-256 uses the CPU's SHA instructions (x86 SHA-NI,
ARMv8), 2x BLAKE2b's rate in hashlib on the CPU box (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Optional

SECRET_ENV = "KVSTORE_REMOTE_SECRET"
_DOMAIN = b"kvstore-remote-block-v1"  # a tag of this layout, never of anything else keyed by the same secret


def secret_bytes(secret: Optional[str]) -> Optional[bytes]:
    """The secret to use: ``secret``, else ``$KVSTORE_REMOTE_SECRET`` (unset or empty: none)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    return None if secret is None else secret.encode()


class Signer:
    """Tags and checks blocks under one secret. ``domain`` names what is
    tagged (remote blocks by default; export files have their own), so no tag
    of one layout is ever taken for another's."""

    __slots__ = ("_base",)

    def __init__(self, secret: bytes, domain: bytes = _DOMAIN):
        self._base = hmac.new(secret, domain, hashlib.sha256)

    def __repr__(self) -> str:
        return "Signer(***)"

    def tag(self, *parts) -> bytes:
        """The tag of ``parts`` (for a block: its key, packed record and payload), each length-prefixed."""
        mac = self._base.copy()
        for part in parts:
            view = memoryview(part)
            mac.update(view.nbytes.to_bytes(8, "big"))
            mac.update(view)
        return mac.digest()

    def valid(self, key: bytes, record, payload, tag) -> bool:
        """Whether ``tag`` is this secret's tag of the block (False for anything missing or not bytes)."""
        if not all(isinstance(x, (bytes, memoryview)) for x in (record, payload, tag)):
            return False
        return hmac.compare_digest(self.tag(key, bytes(record), payload), bytes(tag))
