"""A fixed orthogonal rotation of the head dimension, applied to keys before
quantizing and undone after dequantizing.

Trained models' keys have a few outlier channels (RoPE pairs with large
magnitude); one of them sets the scale of its whole quantization group, and
every other value in that group loses precision. A Walsh-Hadamard transform
with random sign flips spreads each channel over all of them, so the groups
come out flat and 4-bit quantization loses less (as in QuaRot and TurboQuant).
The transform is orthonormal (``R = H diag(s) / sqrt(n)``, with ``H`` the
symmetric Sylvester-Hadamard matrix), so it is undone by its transpose:
``x = s * H y / sqrt(n)``.

The signs come from a seed through xxh3 over explicit bytes, so they are the
same in every process and version; a block records the seed it used.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np
import xxhash

__all__ = ["DEFAULT_SEED", "MAX_DIM", "rotatable", "rotate", "unrotate", "signs"]

DEFAULT_SEED = 0x4B565352  # b"KVSR"
MAX_DIM = 8192  # mx.hadamard_transform's largest power of two in float32
_TAG = b"kvstore-rotation-v1\x00"


def rotatable(dim: int) -> bool:
    """Whether a head dim can be rotated: a power of two (the Sylvester
    matrices mlx builds for them are symmetric, so the transform is its own
    inverse up to the signs). Other dims are stored unrotated."""
    return 2 <= dim <= MAX_DIM and dim & (dim - 1) == 0


@lru_cache(maxsize=64)
def _signs_np(seed: int, dim: int) -> np.ndarray:
    raw = b"".join(xxhash.xxh3_128_digest(_TAG + seed.to_bytes(8, "little") + i.to_bytes(4, "little"))
                   for i in range((dim + 127) // 128))
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:dim]
    return (1.0 - 2.0 * bits).astype(np.float32)


def signs(seed: int, dim: int) -> mx.array:
    """The ``dim`` sign flips (+1/-1, float32) of ``seed``."""
    return mx.array(_signs_np(seed, dim))


def _check(dim: int) -> None:
    if not rotatable(dim):
        raise ValueError(f"head dim {dim} cannot be rotated (a power of two up to {MAX_DIM} is needed)")


def rotate(x: mx.array, seed: int) -> mx.array:
    """``x`` rotated along its last axis (computed in float32, returned in ``x``'s dtype)."""
    _check(x.shape[-1])
    return mx.hadamard_transform(x.astype(mx.float32) * signs(seed, x.shape[-1])).astype(x.dtype)


def unrotate(y: mx.array, seed: int) -> mx.array:
    """The inverse of :func:`rotate`."""
    _check(y.shape[-1])
    return (mx.hadamard_transform(y.astype(mx.float32)) * signs(seed, y.shape[-1])).astype(y.dtype)
