"""ttft: time to first token on the tiny llama: cold prefill vs a kvstore hit
from RAM and from SSD (page-cached and cold) vs an mlx-lm ``LRUPromptCache`` hit."""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import cold_ttft, describe_model, drop_page_cache, load_tiny, log, rand_tokens, stat


def run(cfg: dict, R: int, tmp: Path) -> dict:
    import mlx_lm
    from mlx_lm.models import cache as C

    from kvstore import PrefixStore
    from kvstore.adapters.generate import generate, model_key, store_cache

    c = cfg["ttft"]
    model, tok, _ = load_tiny("llama")
    # the key generate() finds without model_path (with one, it would register the model in
    # LMDB, a write inside the timed request)
    mkey = model_key(model)
    rng = np.random.default_rng(40)
    words, per_token = describe_model("llama", model)
    res: dict[str, Any] = {"model": words, "kv_bytes_per_token": per_token, "lengths": {}}
    for n in c["lengths"]:
        prompt = rand_tokens(rng, n).tolist()
        log(f"ttft: {n} tokens")
        # cold: plain mlx-lm, no cache; the last cold run's cache seeds every cache below
        cold, cache, first = cold_ttft(model, tok, prompt, R)
        full = prompt + [first]  # what the cache holds after one generated token
        e: dict[str, Any] = {"cold": stat(cold)}
        # kvstore RAM
        store = PrefixStore(budget_gb=4, block_size=256)
        store_cache(store, mkey, full, cache)
        store.flush()
        ram, cached = [], []
        for _ in range(c["hit_repeats"]):
            g = generate(model, tok, prompt, store=store, max_tokens=1)
            ram.append(g.ttft_s)
            cached.append(g.ram_tokens)
            store.flush()
        store.close()
        assert min(cached) == n - 1, cached  # every request a hit of all but the last token
        e["kvstore_ram"] = dict(stat(ram), cached_tokens=cached[-1])
        # kvstore SSD: close + reopen; page-cached, then cold (LMDB file pages dropped)
        spath = tmp / f"ttft-{n}"
        store = PrefixStore(budget_gb=4, ssd_path=spath, block_size=256)
        store_cache(store, mkey, full, cache)
        store.close()
        for label, cold_disk in (("kvstore_ssd", False), ("kvstore_ssd_cold", True)):
            ts, ssd_tok = [], []
            for _ in range(c["hit_repeats"]):
                if cold_disk:
                    drop_page_cache(spath / "data.mdb")
                s = PrefixStore(budget_gb=4, ssd_path=spath, block_size=256)
                g = generate(model, tok, prompt, store=s, max_tokens=1)
                ts.append(g.ttft_s)
                ssd_tok.append(g.ssd_tokens)
                s.close()
            assert min(ssd_tok) == n - 1, (label, ssd_tok)
            e[label] = dict(stat(ts), cached_tokens=ssd_tok[-1])
        shutil.rmtree(spath)
        # mlx-lm LRUPromptCache
        lru = C.LRUPromptCache(max_size=10)
        lru.insert_cache(mkey, list(full), cache)
        ts = []
        for _ in range(c["hit_repeats"]):
            t0 = time.perf_counter()
            pc, rest = lru.fetch_nearest_cache(mkey, prompt)
            if not rest:  # exact entry: leave one token to compute
                C.trim_prompt_cache(pc, 1)
                rest = prompt[-1:]
            got = n - len(rest)
            for resp in mlx_lm.stream_generate(model, tok, rest, max_tokens=1, prompt_cache=pc):
                ts.append(time.perf_counter() - t0)
                break
            del pc
        e["lru_prompt_cache"] = dict(stat(ts), cached_tokens=got)
        base = e["cold"]["median_s"]
        e["speedup_vs_cold"] = {k: base / v["median_s"] for k, v in e.items() if k != "cold" and "median_s" in v}
        e["kvstore_ram_vs_lru"] = e["kvstore_ram"]["median_s"] / e["lru_prompt_cache"]["median_s"]
        res["lengths"][str(n)] = e
        del cache
        gc.collect()
    return res
