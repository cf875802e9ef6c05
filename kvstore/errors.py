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


class InputError(KVStoreError, ValueError, TypeError):
    """An argument of a call is malformed: tokens that are not a flat sequence
    of integers within signed 64 bits, a model key that is not a non-empty
    ``str`` or ``bytes``, a ``limit`` that is not an int. Nothing was stored
    or changed. (Both a ``ValueError`` and a ``TypeError``, for code that
    catches either.)"""


class ConfigError(KVStoreError, ValueError):
    """A setting is out of range (a budget that is negative, NaN or infinite,
    unsupported bits or group size, a bad block size). Raised at construction."""


class StoreClosedError(KVStoreError):
    """The store was used after ``close()``. Open a new ``PrefixStore``."""


class ReadOnlyError(KVStoreError):
    """A write (``put``, ``clear``) on a store opened with ``readonly=True``."""


class StorageError(KVStoreError):
    """The LMDB environment could not complete an operation (its map could not
    grow, another process kept resizing it). The store turns these into misses
    and skipped writes on the engine's path; maintenance commands report them."""


class RemoteConfigError(ConfigError):
    """The ``remote`` setting cannot work: a malformed URL, a missing client
    library, or a server that refused the credentials. Raised at open; the
    message names the URL without its password. (A server that is merely
    down is not an error: the store opens on its local tiers.)"""


class TransferError(KVStoreError):
    """``kvstore import`` refuses a file: not an export file, another format
    version, truncated, damaged (a checksum that does not match), or of
    another block size than the target store. The file is checked whole
    before anything is written, so a refused file imported nothing."""
