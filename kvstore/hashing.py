"""Block keys: a chain of xxh3-128 digests over int32 token bytes.

Key of block i = xxh3_128(key of block i-1 || tokens of block i as little-endian
int32). The chain starts at a root key that fingerprints the model and the
namespace, so equal prefixes of one model give equal keys (dedup) and nothing
crosses models or tenants. Only explicit bytes are hashed: keys are the same in
every process (Python's ``hash()`` is salted per process).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import xxhash

KEY_BYTES = 16
_ROOT_TAG = b"kvstore-root-v1\x00"


def root_key(model_key: Union[str, bytes], namespace: Optional[str] = None) -> bytes:
    """The key every block chain of ``model_key`` (within ``namespace``) starts at."""
    if isinstance(model_key, str):
        model_key = model_key.encode()
    ns = b"" if namespace is None else b"\x01" + namespace.encode()
    return xxhash.xxh3_128_digest(_ROOT_TAG + len(model_key).to_bytes(4, "little") + model_key + ns)


def as_tokens(tokens: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """Tokens as a contiguous little-endian int32 array; rejects what int32 can't hold."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
        return np.ascontiguousarray(tokens)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2**31)")
    return np.ascontiguousarray(arr, dtype="<i4")


def chain_key(parent: bytes, block_tokens: np.ndarray) -> bytes:
    """Key of a block (full or partial) whose parent key is ``parent``."""
    return xxhash.xxh3_128_digest(parent + block_tokens.tobytes())


class KeyChain:
    """Keys of one prompt's blocks, computed on demand and remembered.

    A lookup stops at the first block the index lacks, so a miss on a 128K
    prompt hashes only as far as it walked.
    """

    def __init__(self, root: bytes, tokens: np.ndarray, block_size: int):
        self.root = root
        self.tokens = tokens
        self.block_size = block_size
        self.n_full = len(tokens) // block_size
        self._keys: list[bytes] = []

    def key(self, i: int) -> bytes:
        """Key of full block ``i``."""
        bs = self.block_size
        while len(self._keys) <= i:
            j = len(self._keys)
            parent = self._keys[-1] if self._keys else self.root
            self._keys.append(chain_key(parent, self.tokens[j * bs : (j + 1) * bs]))
        return self._keys[i]

    def parent(self, i: int) -> bytes:
        """Key of the block before block ``i`` (the root for block 0)."""
        return self.root if i == 0 else self.key(i - 1)

    def tail_key(self, i: int, length: int) -> bytes:
        """Key of a partial block of ``length`` tokens at block position ``i``."""
        start = i * self.block_size
        return chain_key(self.parent(i), self.tokens[start : start + length])
