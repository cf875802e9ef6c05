"""lookup: key hashing and the index walk of a long prompt against an index of
many blocks, and ``contains`` / ``fetch`` of it on a store.

The walk is timed on a ``kvstore.state.index.RadixIndex`` built here with the
prompt's chain plus filler chains (the store's own index is not public);
``contains`` is timed on a store holding the prompt, and the walk is timed on
an index of the prompt alone too, to show what the filler changes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import kv_layers, log, rand_tokens, stat, timed
from .settings import TARGETS

NEXT_TURN_TOKENS = 700  # new tokens after the stored prompt in the "next turn" lookup
FILLER_CHAIN = 512  # blocks per filler chain, every chain under the prompt's root


def run(cfg: dict, R: int, tmp: Path) -> dict:
    from kvstore import PrefixStore
    from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
    from kvstore.state.index import RadixIndex

    c = cfg["lookup"]
    reps = c["repeats"]
    n, filler = c["tokens"], c["filler"]
    bs = 256
    rng = np.random.default_rng(20)
    key = "bench-lookup"
    store = PrefixStore(budget_gb=8, block_size=bs)
    toks = rand_tokens(rng, n, 100_000)
    toks_list = toks.tolist()
    # the measured prompt's blocks: real KV (the tiny llama's shape: 2 layers, 1 head, dim 64)
    layers = kv_layers(rng, 2, 1, 64, n)
    store.put(key, toks, layers)
    store.flush()
    del layers
    rk = root_key(key, store.namespace)

    def hash_np():
        ch = KeyChain(rk, as_tokens(toks), bs)
        return [ch.key(i) for i in range(n // bs)]

    def hash_list():
        ch = KeyChain(rk, as_tokens(toks_list), bs)
        return [ch.key(i) for i in range(n // bs)]

    pkeys = hash_np()

    def index_of_prompt() -> RadixIndex:
        index = RadixIndex()
        node = index.root(rk)
        for i, k in enumerate(pkeys):
            node = index.add(node, k, node.end, bs, int(toks[i * bs]))
        return index

    # filler blocks: chains of FILLER_CHAIN blocks under the prompt's root
    t0 = time.perf_counter()
    big = index_of_prompt()
    root = big.root(rk)
    keys = np.frombuffer(os.urandom(16 * filler), dtype="S16")
    firsts = rng.integers(5, 100_000, filler)
    node = root
    for i in range(filler):
        if i % FILLER_CHAIN == 0:
            node = root
        node = big.add(node, keys[i].tobytes(), node.end, bs, int(firsts[i]))
    build_s = time.perf_counter() - t0
    log(f"lookup: index holds {len(big):,} blocks (filler built in {build_s:.1f} s)")
    small = index_of_prompt()
    small_root = small.root(rk)
    res: dict[str, Any] = {"prompt_tokens": n, "block_size": bs, "blocks_indexed": len(big),
                           "prompt_blocks": n // bs, "filler_build_s": build_s, "filler_chain_blocks": FILLER_CHAIN,
                           "next_turn_new_tokens": NEXT_TURN_TOKENS}
    assert big.match(root, pkeys).length == small.match(small_root, pkeys).length == n
    assert store.contains(key, toks) == n
    other = toks.copy()
    other[n - 100] += 1  # diverges inside the last block: a partial hit
    assert store.contains(key, other) == n - 100
    ext = np.concatenate([toks, rand_tokens(rng, NEXT_TURN_TOKENS, 100_000)])  # the next turn
    res["hash_only_np"] = stat(timed(hash_np, reps, warmup=2))
    res["hash_only_list"] = stat(timed(hash_list, reps, warmup=2))
    res["as_tokens_list"] = stat(timed(lambda: as_tokens(toks_list), reps, warmup=2))
    res["walk_only"] = stat(timed(lambda: big.match(root, pkeys), reps, warmup=2))
    res["walk_only_prompt_index"] = stat(timed(lambda: small.match(small_root, pkeys), reps, warmup=2))
    res["contains_np"] = stat(timed(lambda: store.contains(key, toks), reps, warmup=2))
    res["contains_list"] = stat(timed(lambda: store.contains(key, toks_list), reps, warmup=2))
    res["contains_partial_np"] = stat(timed(lambda: store.contains(key, other), reps, warmup=2))
    res["contains_next_turn_np"] = stat(timed(lambda: store.contains(key, ext), reps, warmup=2))
    miss = rand_tokens(rng, n, 100_000)
    res["contains_miss_np"] = stat(timed(lambda: store.contains(key, miss), reps, warmup=2))
    kv_bytes = store.nbytes
    res["fetch_full"] = stat(timed(lambda: store.fetch(key, toks), max(3, R), warmup=1), kv_bytes)
    res["fetch_full"]["kv_bytes"] = kv_bytes
    res["store_blocks"] = len(store)
    res["target_ms"] = TARGETS["lookup_ms"]
    res["met"] = res["contains_np"]["median_s"] * 1e3 < TARGETS["lookup_ms"]
    res["met_list_input"] = res["contains_list"]["median_s"] * 1e3 < TARGETS["lookup_ms"]
    store.close()
    return res
