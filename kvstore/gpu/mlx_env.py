"""What mlx's CUDA backend is told before it starts, so that a process that
meets new prompt shapes for as long as it runs (a server) is not ended by one.

mlx's CUDA backend builds a cuDNN attention graph for each exact q/k/v shape
and stride and keeps it in an LRU cache (``MLX_CUDA_SDPA_CACHE_SIZE``, 256);
that cache, like mlx's other CUDA caches, counts its misses over the
process's life and throws "Cache thrashing is happening" once they pass twice
its size (``mlx/backend/cuda/lru_cache.h``). A server sees a new prompt length
on nearly every request: with mlx's defaults it fails after about 500
distinct ones. ``MLX_ENABLE_CACHE_THRASHING_CHECK=0`` takes that throw away
in every cache that has the check; each keeps its size and evicts as
before, and mlx builds and runs the same graphs and kernels, so outputs are
unchanged (mlx's source; the figures that check it on a GPU: ``kvstore bench
new-shapes`` and tests/test_cuda_new_shapes.py, docs/engines.md, "On CUDA:
new prompt shapes").

mlx reads the variable when it makes a cache, which can be as early as the
backend's start, so it is set when kvstore is imported, before kvstore
imports mlx, and every ``kvstore`` command (``serve``, ``run``'s engine, which
inherits the environment, ``omlx serve``, ``vllm-mlx serve``) has it. A value
the user set wins; a process that started mlx before importing kvstore keeps
what mlx read then. Metal has no such caches: nothing is set on macOS.
"""

from __future__ import annotations

import os
import sys

__all__ = ["DEFAULTS", "keep_new_shapes_alive"]

DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def keep_new_shapes_alive() -> dict[str, str]:
    """Set each of ``DEFAULTS`` the user has not set (not on macOS); the values in effect."""
    if sys.platform == "darwin":
        return {}
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in DEFAULTS}
