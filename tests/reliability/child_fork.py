"""Puts a prompt (so the store's writer and commit threads have run), forks,
and in the child puts another and flushes: the child's put must be written by
threads of the child's own (the parent's are gone there; a queue one of them
waited on would hand the job to it). Prints what the child saw.

Usage: child_fork.py SSD_PATH
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

store = PrefixStore(budget_gb=0.1, ssd_path=sys.argv[1], block_size=D.BLOCK)
first = D.tokens(80_000, 100)
store.put("fork-model", first, D.layers_for(first))
store.flush()
pid = os.fork()
if pid == 0:
    toks = D.tokens(80_001, 100)
    store.put("fork-model", toks, D.layers_for(toks))
    store.flush(timeout=30)
    hit = store.fetch("fork-model", toks)
    print("child", store.stats()["pending_jobs"], store.stats()["ssd_blocks"], hit.length, D.hit_problem(hit, toks),
          flush=True)
    os._exit(0)
os.waitpid(pid, 0)
store.close()
