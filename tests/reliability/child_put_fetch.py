"""Opens a store, puts N prompts, flushes, fetches them back exactly, closes;
prints "ok N". Exit 3 on a wrong or short hit.

Usage: child_put_fetch.py SSD_PATH SEED N [MODEL]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

path, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = sys.argv[4] if len(sys.argv) > 4 else "crash-model"
with PrefixStore(budget_gb=0.01, ssd_path=path, block_size=D.BLOCK) as store:
    prompts = [D.writer_prompt(seed, i) for i in range(n)]
    for toks in prompts:
        store.put(model, toks, D.layers_for(toks))
    store.flush()
    for toks in prompts:
        hit = store.fetch(model, toks)
        why = D.hit_problem(hit, toks)
        if why or hit.length != len(toks):
            print(f"WRONG {why} length {hit.length}/{len(toks)}", flush=True)
            sys.exit(3)
print(f"ok {n}", flush=True)
