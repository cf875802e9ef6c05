"""Puts prompts into an SSD store and exits without close() or flush(), in one
of several ways; interpreter exit (atexit) must flush what is still queued.
Prints how many puts were still pending when it stopped.

Usage: child_exit.py SSD_PATH N HOW   (HOW: return | sys_exit | exception | dropped)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

path, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def work() -> None:
    store = PrefixStore(budget_gb=0.1, ssd_path=path, block_size=D.BLOCK)
    for i in range(n):
        toks = D.tokens(70_000 + i, 100)
        store.put("exit-model", toks, D.layers_for(toks))
    print("pending", store.stats()["pending_jobs"], flush=True)
    if how == "sys_exit":
        sys.exit(0)
    if how == "exception":
        raise RuntimeError("the engine crashed (an ordinary exception, not a kill)")


work()  # "dropped": the store is not referenced any more once this returns
