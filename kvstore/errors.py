"""Exceptions the store raises. Engines catch ``KVStoreError``; the store itself
turns every storage fault on the fetch path into a miss rather than raising."""


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class StoreOpenError(KVStoreError):
    """``ssd_path`` cannot be used: not a kvstore store, another format version,
    locked, or unreadable. The message names the path and what to do."""


class BlockDecodeError(KVStoreError):
    """A stored block is malformed, truncated, of another format, or fails its
    checksum. Never raised into an engine by ``fetch``: the block is a miss."""


class LayoutError(KVStoreError, ValueError):
    """Arrays handed to ``put`` do not fit together (shapes, dtypes, lengths)."""
