"""One of several processes sharing an SSD store. Each round it stores its
own prompts (which share prefixes with the other workers' prompts of the same
round, down to the last partial block), flushes, announces it with a marker
file, waits for every other worker's marker, then fetches their prompts: each
must be served whole and exact from what they wrote.

Prints "ok FETCHES" and exits 0; prints "WRONG ..." and exits 3 on a short or
wrong hit; exits 4 when another worker never announced a round.

Usage: child_sharer.py SSD_PATH SYNC_DIR WORKER N_WORKERS ROUNDS
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402

MODEL = "shared-model"


def round_prompts(worker: int, r: int) -> list:
    common = D.shared_prefix(100 + r, 64)  # four full blocks every worker has this round
    return [
        D.tokens(10_000 * r + worker, 72, common),  # ... then a partial block of its own
        D.tokens(10_000 * r + 100 + worker, 64 + 16 * worker + 5, common[:40]),  # diverges mid-block
        D.tokens(10_000 * r + 200 + worker, 48, common[:48]),  # a full-block prefix of the others
    ]


def main() -> None:
    path, sync, me, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    fetches = 0
    with PrefixStore(budget_gb=0.0005, ssd_path=path, block_size=D.BLOCK) as store:
        for r in range(rounds):
            for toks in round_prompts(me, r):
                store.put(MODEL, toks, D.layers_for(toks))
            store.flush()
            D.announce_and_wait(sync, r, me, n)
            for w in range(n):
                for rr in {r, max(0, r - 3)}:  # this round, and one written a while ago
                    for toks in round_prompts(w, rr):
                        D.fetch_whole_or_exit(store, MODEL, toks,
                                              f"worker {me} round {r}: prompt of worker {w} round {rr}")
                        fetches += 1
    print(f"ok {fetches}", flush=True)


if __name__ == "__main__":
    main()
