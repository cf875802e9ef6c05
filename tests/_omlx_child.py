"""Child process for test_omlx: ``python -m tests._omlx_child MODEL STORE PROMPT_JSON``.

Runs oMLX's engine on the store at STORE, answers the prompt at temperature 0,
flushes the store, prints the answer as JSON, then waits to be killed (the test
SIGKILLs it: no shutdown hook runs).
"""

from __future__ import annotations

import json
import sys
import time

from mlx_lm import load
from omlx.engine_core import EngineConfig, EngineCore
from omlx.request import SamplingParams
from omlx.scheduler import SchedulerConfig

from kvstore import PrefixStore
from kvstore.adapters import omlx as A


def main(model_path: str, store_path: str, prompt_json: str) -> None:
    model, tokenizer = load(model_path)
    store = PrefixStore(budget_gb=1, ssd_path=store_path, block_size=64)
    installed = A.install(store, model_path=model_path, calibrate_prefill=False)
    config = SchedulerConfig(paged_ssd_cache_dir=f"{store_path}-omlx", paged_cache_block_size=64)
    engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
    out = engine.generate_batch_sync([json.loads(prompt_json)], SamplingParams(max_tokens=8, temperature=0.0))
    installed.flush()
    print(json.dumps(out[0].output_token_ids), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
