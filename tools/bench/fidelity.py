"""fidelity: logit error, KL and top-1 / greedy agreement of quantized entries
vs a cold prefill, on the tiny llama, gemma3_text and qwen3_next models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .common import load_tiny, log, rand_tokens, run_tokens


def _codec_name(codec) -> str:
    if codec is None:
        return "fp16"
    if isinstance(codec, tuple):
        return f"K{codec[0]}/V{codec[1]}"
    return f"{codec}-bit"


def _greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    y = int(mx.argmax(logits).item())
    for _ in range(n):
        out.append(y)
        lg = model(mx.array([[y]]), cache=cache)
        y = int(mx.argmax(lg[0, -1]).item())
    return out


def run(cfg: dict, R: int, tmp: Path) -> dict:
    from mlx_lm.models import cache as C

    from kvstore import PrefixStore
    from kvstore.adapters.generate import fetch_cache, model_key, prefill, store_cache

    c = cfg["fidelity"]
    res: dict[str, Any] = {"prompts": c["prompts"], "prompt_len": c["prompt_len"], "stored_prefix": c["prefix"],
                           "greedy_tokens": c["gen"], "models": {}}
    for kind in c["kinds"]:
        model, tok, path = load_tiny(kind)
        mkey = model_key(model, path)
        vocab = model.args.vocab_size
        rng = np.random.default_rng(60)
        prompts = [rand_tokens(rng, c["prompt_len"], vocab).tolist() for _ in range(c["prompts"])]
        cold = []
        for p in prompts:
            cache = C.make_prompt_cache(model)
            lg = run_tokens(model, cache, p)
            cold.append((lg, _greedy(model, cache, lg, c["gen"])))
        rows = {}
        for codec in c["codecs"]:
            errs, kls, top1, greedy_prefix, greedy_pos, hits = [], [], [], [], [], []
            for p, (lg0, g0) in zip(prompts, cold):
                store = PrefixStore(budget_gb=1, block_size=256, kv_bits=codec)
                cache0 = C.make_prompt_cache(model)
                prefill(model, cache0, p, 0, c["prefix"], store=store, key=mkey)
                store_cache(store, mkey, p[:c["prefix"]], cache0)
                store.flush()
                got = fetch_cache(store, model, mkey, p)
                hits.append(got.cached_tokens)
                lg = run_tokens(model, got.cache, p[got.cached_tokens:])
                g = _greedy(model, got.cache, lg, c["gen"])
                store.close()
                errs.append(float(mx.max(mx.abs(lg - lg0)).item()))
                lp0 = lg0 - mx.logsumexp(lg0)
                lp = lg - mx.logsumexp(lg)
                kls.append(float(mx.sum(mx.exp(lp0) * (lp0 - lp)).item()))
                top1.append(int(mx.argmax(lg).item()) == int(mx.argmax(lg0).item()))
                same = next((i for i, (a, b) in enumerate(zip(g, g0)) if a != b), len(g0))
                greedy_prefix.append(same / len(g0))
                greedy_pos.append(float(np.mean([a == b for a, b in zip(g, g0)])))
            rows[_codec_name(codec)] = {
                "max_abs_logit_err": max(errs), "mean_abs_logit_err_max": float(np.mean(errs)),
                "kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)), "top1_agree": float(np.mean(top1)),
                "greedy_identical_prefix": float(np.mean(greedy_prefix)), "greedy_position_agree": float(np.mean(greedy_pos)),
                "cached_tokens": hits,
            }
        res["models"][kind] = rows
        log(f"fidelity: {kind} done")
    return res
