"""Puts a one-layer prompt with the main thread's CPU stream in use (an engine
evaluates there), forks, and fetches it in the child: a one-layer fetch is
evaluated on the calling thread's stream, whose mlx thread the child does not
have (it hung). The parent kills a child that has not answered in time.

Usage: child_fork_one_layer.py SSD_PATH
Prints ``child LENGTH PROBLEM`` from the child, or ``child hung``.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

DEADLINE_S = 30  # the fetch takes milliseconds; a child past this has hung

D.LAYERS = 1
store = PrefixStore(budget_gb=0.1, ssd_path=sys.argv[1], block_size=D.BLOCK)
toks = D.tokens(80_100, 100)
layers = D.layers_for(toks)
mx.eval([a for layer in layers for a in (layer.keys, layer.values)])  # the main thread's stream now has its thread
store.put("fork-model", toks, layers)
store.flush()
pid = os.fork()
if pid == 0:
    hit = store.fetch("fork-model", toks)
    print("child", hit.length, D.hit_problem(hit, toks), flush=True)
    os._exit(0)
end = time.monotonic() + DEADLINE_S
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > end:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("child hung", flush=True)
        break
    time.sleep(0.05)
store.close()
