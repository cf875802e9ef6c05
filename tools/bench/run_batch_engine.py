"""A small continuous-batching engine built on mlx-lm's ``BatchGenerator``, as mlx-lm's server uses it:
tests/test_run.py and ``kvstore bench run-ttft --batch`` run it alone and under ``kvstore run``.
``python -m kvstore.tools.bench.run_batch_engine MODEL fresh|keep PROMPT... [-- PROMPT...]``. Each round of prompts (rounds
are separated by ``--``) is inserted at once and run until every sequence finishes; the next round starts
after. ``fresh``: ``insert(prompts)`` with no caches. ``keep``: mlx-lm's ``LRUPromptCache`` as its server
keeps it: each prompt's nearest cache and the tokens it holds go to ``insert_segments(caches=...,
all_tokens=...)``, and finished sequences' caches go back to it. An unrelated warm-up round comes first
(mlx's first-call costs). Prints one JSON line per prompt, in order: greedy tokens and first-token time
(from the round's insert)."""

import json
import sys
import time

from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, trim_prompt_cache

model_path, mode, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
rounds, cur = [], []
for a in rest:
    if a == "--":
        rounds.append(cur)
        cur = []
    else:
        cur.append(a)
rounds.append(cur)
model, tokenizer = load(model_path)
gen = BatchGenerator(model, max_tokens=8, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
lru = LRUPromptCache(max_size=1)  # one entry: a prompt it evicted shows what the store adds


def run(prompts):
    ids = [tokenizer.encode(p) for p in prompts]
    t0 = time.perf_counter()
    if mode == "fresh":
        uids = gen.insert(ids)
    else:
        uids = []
        for p in ids:
            cache, rest = lru.fetch_nearest_cache("m", p)
            if cache is not None and not rest:  # an exact hit: compute the last token again
                trim_prompt_cache(cache, 1)
                rest = p[-1:]
            n = len(p) - len(rest)
            uids += gen.insert_segments([[rest]], caches=[cache] if cache is not None else None,
                                        all_tokens=[p[:n]])
    out = {uid: {"tokens": [], "ttft_s": None, "prompt_tokens": len(p)} for uid, p in zip(uids, ids)}
    pending = set(uids)
    while pending:
        for r in gen.next_generated():
            o = out[r.uid]
            if o["ttft_s"] is None:
                o["ttft_s"] = time.perf_counter() - t0
            if r.finish_reason != "stop":
                o["tokens"].append(r.token)
            if r.finish_reason is not None:
                pending.discard(r.uid)
                if mode == "keep":
                    lru.insert_cache("m", r.all_tokens[:], r.prompt_cache)
    return [out[u] for u in uids]


run(["Warm up with something else entirely. " * 8])
for prompts in rounds:
    for o in run(prompts):
        print(json.dumps(o), flush=True)
gen.close()
