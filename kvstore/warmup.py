"""What a process's first hit on CUDA would pay, paid when a store opens.

A new process's first hits were far slower than later ones of the same size
(docs/benchmarks.md, live replay). A hit lands in a GPU buffer that is made once and
kept (``cuda.landing``: its first use moves it into managed memory with a
copy), its copies run on pinned staging buffers made on first use, and
mlx compiles each kernel (the codec's quantize and dequantize, the copies,
per dtype) the first time it runs. So a store opening on CUDA makes the
landing buffer at its full size and runs one small put and fetch of each
KV dtype through a throwaway store with the same codec, once per process
and codec: kernels compile and buffers are made here, not in a request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, ContextManager, Optional

import mlx.core as mx
import numpy as np

from .gpu import cuda
from .gpu.backend import Backend, choose
from .config import DEFAULT_BLOCK, StoreConfig
from .blocks.layers import KVLayer

log = logging.getLogger("kvstore")

_done: set = set()  # codec settings warmed in this process
_DTYPES = (mx.float16, mx.bfloat16)
_SHAPE = (1, 8, 128)  # (batch, kv heads, head dim) of the throwaway KV: most models' head dim


def warm_device(config: StoreConfig, open_store: Callable[[StoreConfig], ContextManager],
                backend: Optional[Backend] = None) -> float:
    """Warm this process for stores of ``config``'s codec on ``backend`` (default: ``choose()``) where its
    arrays live apart (CUDA), through a throwaway store ``open_store`` makes (``PrefixStore``: the facade
    hands itself in); seconds it took (0 where done, or where memory is one)."""
    backend = backend or choose()
    what = (config.kv_bits, config.kv_group_size, config.rotate_keys, config.rotate_values,
            config.tuning.rotate_keys_at_or_below, config.tuning.rotate_values_at_or_below, config.full_attention_bits,
            config.block_size)
    if not backend.apart or what in _done:
        return 0.0
    _done.add(what)  # (first: the throwaway store below opens without coming here again)
    t0 = time.perf_counter()
    with cuda.landing(cuda.LANDING):
        pass
    n = 2 * (config.block_size or DEFAULT_BLOCK) + 1  # two whole blocks and a tail
    tokens = np.arange(n, dtype=np.int32)
    cfg = replace(config, ssd_path=None, remote=None, readonly=False, budget_gb=1 / 16, device_budget_gb=0,
                  fetch_policy="always", remember_rates=False)
    with open_store(cfg) as s:
        for i, dtype in enumerate(_DTYPES):
            kv = mx.random.normal((*_SHAPE[:2], n, _SHAPE[2]), key=mx.random.key(i)).astype(dtype)
            s.put(f"kvstore-warm-{i}", tokens, [KVLayer(kv, kv), KVLayer(kv, kv)])
        s.flush()
        for i in range(len(_DTYPES)):
            hit = s.fetch(f"kvstore-warm-{i}", tokens)
            mx.eval([a for layer in hit.layers or [] for a in (layer.keys, layer.values)])
    seconds = time.perf_counter() - t0
    log.info("kvstore: warmed this process's %s path for the first hits in %.2f s", backend.name, seconds)
    return seconds
