"""Block keys: a chain of xxh3-128 digests over each block's token bytes.

Key of block i = xxh3_128(key of block i-1 || token bytes of block i). The
chain starts at a root key that fingerprints the model and the namespace, so
equal prefixes of one model give equal keys (dedup) and nothing crosses models
or tenants. Only explicit bytes are hashed: keys are the same in every process
(Python's ``hash()`` is salted per process).

Token ids are signed 64-bit (mlx-lm's server keys an image's patch tokens by a
~60-bit negative id). A block's tokens are hashed as little-endian int32 when
every id of *that block* fits int32 -- so the text blocks before an image have
the same keys in a text-only prompt and in an image prompt, and keys of text
prompts are what they always were -- else as a tag byte and little-endian
int64. The two encodings cannot give the same bytes for different runs: int32
runs are 4n bytes long, tagged int64 runs 8n + 1 (odd).
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence, Union

import numpy as np
import xxhash

from ..errors import InputError

_ROOT_TAG = b"kvstore-root-v1\x00"
_WIDE_TAG = b"\x01"  # precedes the int64 bytes of a block with an id outside int32
_I32 = np.iinfo(np.int32)
_INT_IS_32 = array("i").itemsize == 4
_I64 = np.iinfo(np.int64)
TOKEN_DTYPES = (np.dtype("<i4"), np.dtype("<i8"))  # the widths a token array may have


def root_key(model_key: Union[str, bytes], namespace: Optional[str] = None) -> bytes:
    """The key every block chain of ``model_key`` (within ``namespace``) starts at.
    Raises ``InputError`` for a model key that is not a str or bytes, or is
    empty (every model has a name)."""
    if not isinstance(model_key, (str, bytes)) or not model_key:
        raise InputError(f"model_key must be a non-empty str or bytes (see kvstore.adapters.generate.model_key), "
                         f"got {'an empty one' if isinstance(model_key, (str, bytes)) else repr(model_key)}")
    if isinstance(model_key, str):
        model_key = model_key.encode()
    ns = b"" if namespace is None else b"\x01" + namespace.encode()
    return xxhash.xxh3_128_digest(_ROOT_TAG + len(model_key).to_bytes(4, "little") + model_key + ns)


def _fits_int32(arr: np.ndarray) -> bool:
    return arr.size == 0 or (int(arr.min()) >= _I32.min and int(arr.max()) <= _I32.max)


def as_tokens(tokens: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """Tokens as a contiguous little-endian array: int32 when every id fits
    (the fast path, and every text prompt), else int64. Raises ``InputError``
    for anything but a flat sequence of integers within signed 64 bits."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
        return np.ascontiguousarray(tokens, dtype="<i4")
    if type(tokens) is list and tokens and not isinstance(tokens[0], bool) and _INT_IS_32:
        fast = _int32_list(tokens)
        if fast is not None:
            return fast
    if not isinstance(tokens, np.ndarray):
        tokens = _array_of(tokens)
    return _flat_ids(tokens)


def _int32_list(tokens: list) -> Optional[np.ndarray]:
    """A prompt as engines hand it over, a list of ints, read at C speed (numpy would go through int64,
    then check the range and narrow); None for floats, nested lists and wider ids (the general path's)."""
    try:
        return np.frombuffer(array("i", tokens), dtype="=i4").astype("<i4", copy=False)
    except (TypeError, OverflowError):
        return None


def _array_of(tokens) -> np.ndarray:
    """``tokens`` (not an array) as one; ``InputError`` naming what is wrong with a non-integer sequence."""
    if isinstance(tokens, (str, bytes)) or not (isinstance(tokens, Sequence) or hasattr(tokens, "__array__")):
        raise InputError(f"tokens must be a flat sequence of ints, got {type(tokens).__name__}")
    given = tokens if isinstance(tokens, Sequence) else ()
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError):  # a ragged list, ids past 64 bits
        arr = np.asarray(tokens, dtype=object)
    if arr.dtype.kind not in "iu" and arr.size:
        # numpy turns [2**63, 0] into floats and ids past 64 bits into objects: name what is wrong
        if all(isinstance(t, int) and not isinstance(t, bool) for t in given):
            raise InputError("token ids must fit in signed 64 bits")
        raise InputError(f"tokens must be a flat sequence of ints (no floats, bools, strings or nested "
                         f"lists), got {arr.dtype} values")
    return arr


def _flat_ids(arr: np.ndarray) -> np.ndarray:
    """An array of token ids checked (integers, flat, within int64) and in its narrowest width."""
    if arr.dtype.kind not in "iu" and arr.size:
        raise InputError(f"tokens must be integers, got an array of {arr.dtype}")
    if arr.ndim != 1:
        raise InputError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype == np.uint64 and int(arr.max()) > _I64.max:
        raise InputError("token ids must fit in signed 64 bits")
    return np.ascontiguousarray(arr, dtype="<i4" if _fits_int32(arr) else "<i8")


def narrowest(tokens: np.ndarray) -> np.ndarray:
    """``tokens`` as int32 when every id fits, else as they are (int64): a
    stored block carries the width its own ids need."""
    if tokens.dtype != np.int32 and _fits_int32(tokens):
        return tokens.astype("<i4")
    return tokens


def token_bytes(block_tokens: np.ndarray) -> bytes:
    """The bytes a block's tokens are hashed as (see the module docstring)."""
    if block_tokens.dtype == np.int32:
        return block_tokens.tobytes()
    if _fits_int32(block_tokens):
        return block_tokens.astype("<i4").tobytes()
    return _WIDE_TAG + block_tokens.astype("<i8").tobytes()


def chain_key(parent: bytes, block_tokens: np.ndarray) -> bytes:
    """Key of a block (full or partial) whose parent key is ``parent``."""
    return xxhash.xxh3_128_digest(parent + token_bytes(block_tokens))


class KeyChain:
    """Keys of one prompt's blocks, computed on demand and remembered.

    A lookup stops at the first block the index lacks, so a miss on a 128K
    prompt hashes only as far as it walked.
    """

    def __init__(self, root: bytes, tokens: np.ndarray, block_size: int):
        self.root = root
        self.tokens = tokens
        self.block_size = block_size
        self._keys: list[bytes] = []

    def key(self, i: int) -> bytes:
        """Key of full block ``i``."""
        keys = self._keys
        if len(keys) > i:
            return keys[i]
        bs = self.block_size
        if self.tokens.dtype == np.int32:  # every block hashes its slice of one bytes object (a put's hot loop)
            step = 4 * bs
            raw = self.tokens[len(keys) * bs : (i + 1) * bs].tobytes()
            k = keys[-1] if keys else self.root
            digest = xxhash.xxh3_128_digest
            for o in range(0, len(raw), step):
                k = digest(k + raw[o : o + step])
                keys.append(k)
            return keys[i]
        while len(keys) <= i:
            j = len(keys)
            keys.append(chain_key(keys[-1] if keys else self.root, self.tokens[j * bs : (j + 1) * bs]))
        return keys[i]

    def first(self, m: int) -> list[bytes]:
        """Keys of full blocks ``0 .. m-1``, computed in one go."""
        if m > 0:
            self.key(m - 1)
        return self._keys[:m]

    def parent(self, i: int) -> bytes:
        """Key of the block before block ``i`` (the root for block 0)."""
        return self.root if i == 0 else self.key(i - 1)

    def tail_key(self, i: int, length: int) -> bytes:
        """Key of a partial block of ``length`` tokens at block position ``i``."""
        start = i * self.block_size
        return chain_key(self.parent(i), self.tokens[start : start + length])
