"""One of two processes writing large prompts into one store, so that both
grow its map while the other reads and writes. Each round it stores a prompt
of its own, flushes, announces it with a marker file, waits for the other's
marker, then fetches every prompt either process stored so far: each must be
served whole and exact (from disk: the RAM budget holds almost nothing).

Prints "writemap FLAG" (how this process opened the store), then "ok FETCHES"
and exits 0; prints "WRONG ..." and exits 3 on a short or wrong hit; exits 4
when the other process never announced a round.

Usage: child_grower.py SSD_PATH SYNC_DIR WORKER N_WORKERS ROUNDS TOKENS
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

MODEL = "grow-model"


def prompt(worker: int, r: int, n: int):
    return D.tokens(20_000 + 1000 * r + worker, n)


def main() -> None:
    path, sync = sys.argv[1], sys.argv[2]
    me, workers, rounds, n = (int(a) for a in sys.argv[3:7])
    fetches = 0
    with PrefixStore(budget_gb=0.0005, ssd_path=path, block_size=D.BLOCK) as store:
        print("writemap", store._disk._tier.env.flags()["writemap"], flush=True)
        for r in range(rounds):
            toks = prompt(me, r, n)
            store.put(MODEL, toks, D.layers_for(toks))
            store.flush()
            D.announce_and_wait(sync, r, me, workers)
            for w in range(workers):
                for rr in range(r + 1):
                    D.fetch_whole_or_exit(store, MODEL, prompt(w, rr, n),
                                          f"worker {me} round {r}: prompt of worker {w} round {rr}")
                    fetches += 1
    print(f"ok {fetches}", flush=True)


if __name__ == "__main__":
    main()
