"""A store opened and used before ``fork()``, then used by parent and child at
once: each puts prompts of its own and reads the other's and the shared one.
Prints one line per process: ``<who> <whose-reader-slot> <problems>``, where
the slot says under which pid LMDB registered this process's read transaction
(its own: ``own``; an environment carried across ``fork()`` registers the
child's readers under the parent's pid, which other processes then take for
stale once the parent exits).

Usage: child_fork_both.py SSD_PATH
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

MODEL = "fork-model"
store = PrefixStore(budget_gb=0.0, ssd_path=sys.argv[1], block_size=D.BLOCK)  # no RAM: every hit reads LMDB
shared = D.tokens(90_000, 100)
mine = {who: [D.tokens(90_001 + 10 * i + j, 100, shared[:40]) for j in range(4)]
        for i, who in enumerate(("parent", "child"))}
layers = {who: [D.layers_for(t) for t in ps] for who, ps in mine.items()}  # made before the fork (no mlx ops after)
store.put(MODEL, shared, D.layers_for(shared))
store.flush()
assert store.fetch(MODEL, shared).length == 100  # the parent has read through its environment
to_parent, to_child = os.pipe(), os.pipe()  # (read end, write end) each
pid = os.fork()
who = "child" if pid == 0 else "parent"
other = "parent" if who == "child" else "child"
problems = []
for t, l in zip(mine[who], layers[who]):
    store.put(MODEL, t, l)
store.flush()
for t in [shared, *mine[who]]:
    hit = store.fetch(MODEL, t)
    if hit.length != len(t) or D.hit_problem(hit, t):
        problems.append(f"own:{hit.length}:{D.hit_problem(hit, t)}")
# each reads the other's prompts once they are on disk: each says so after its flush, and waits to be told
os.write((to_parent if pid == 0 else to_child)[1], b"x")
os.read((to_child if pid == 0 else to_parent)[0], 1)
for t in mine[other]:
    hit = store.fetch(MODEL, t)
    if hit.length != len(t) or D.hit_problem(hit, t):
        problems.append(f"other:{hit.length}:{D.hit_problem(hit, t)}")
disk = store._disk._tier
with disk.reader():
    pids = {int(line.split()[0]) for line in disk.env.readers().splitlines()[1:] if line.strip()}
line = f"{who} {'own' if os.getpid() in pids else f'of:{sorted(pids)}'} {','.join(problems) or 'ok'}\n"
os.write(1, line.encode())  # one write: the two processes share the pipe
if pid == 0:
    store.close()
    os._exit(0)
_, status = os.waitpid(pid, 0)
store.close()
sys.exit(os.waitstatus_to_exitcode(status))
