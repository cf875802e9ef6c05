"""A small engine of kvstore's own, built on mlx-lm as engines are: tests/test_run.py and
``kvstore bench run-ttft`` run it alone and under ``kvstore run``. ``python -m kvstore.tools.bench.run_engine MODEL
fresh|keep PROMPT...`` loads MODEL with ``mlx_lm.load`` and answers each prompt greedily with
``stream_generate``, printing one JSON line each (tokens, first-token time). ``fresh``: a new prompt cache
per request. ``keep``: one cache across requests, trimmed to the prefix the next prompt shares with what it
holds (as mlx-lm's server and mlx-omni-server keep theirs)."""

import json
import sys
import time

from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

model_path, mode, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
model, tokenizer = load(model_path)
cache, held = make_prompt_cache(model), []
for prompt in prompts:
    ids = tokenizer.encode(prompt)
    if mode == "fresh":
        cache, held = make_prompt_cache(model), []
    common = 0
    while common < min(len(held), len(ids) - 1) and held[common] == ids[common]:
        common += 1
    trim_prompt_cache(cache, len(held) - common)
    t0, ttft, out = time.perf_counter(), None, []
    for r in stream_generate(model, tokenizer, ids[common:], max_tokens=8, prompt_cache=cache):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        out.append(r.token)
    if mode == "keep":  # (a trimmable cache: every layer has an offset)
        held = (ids + out)[: cache[0].offset]
    print(json.dumps({"tokens": out, "ttft_s": ttft, "prompt_tokens": len(ids)}), flush=True)
