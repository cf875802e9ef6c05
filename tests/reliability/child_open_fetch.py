"""Opens a store, fetches one prompt and checks it bit for bit, optionally
puts another, closes. Prints "StoreOpenError: ..." (exit 0) when the store
cannot be opened, else "opened; hit LENGTH PROBLEM" then "closed".

Runs in a child so that a data file LMDB cannot map (truncated, on a full
device) shows as a signal in the parent instead of killing the test run.

Usage: child_open_fetch.py SSD_PATH MODEL PROMPT_ID LENGTH BUDGET_GB [PUT_PROMPT_ID]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore, StoreOpenError  # noqa: E402

path, model, prompt_id, n, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
try:
    store = PrefixStore(budget_gb=budget, ssd_path=path, block_size=D.BLOCK)
except StoreOpenError as e:
    print("StoreOpenError:", e)
    sys.exit(0)
toks = D.tokens(prompt_id, n)
hit = store.fetch(model, toks)
print("opened; hit", hit.length, D.hit_problem(hit, toks))
if len(sys.argv) > 6:
    more = D.tokens(int(sys.argv[6]), n)
    store.put(model, more, D.layers_for(more))
store.close()
print("closed")
