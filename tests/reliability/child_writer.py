"""Crash-test writer: puts prompts into an SSD store forever, flushing every
few puts, and logs its progress line by line (unbuffered) so the parent knows,
after SIGKILLing it, which prompts were durably flushed:

    ready          store opened
    F <i>          flush started with prompts 0..i put
    D <i>          flush returned: prompts 0..i are committed
    WRONG <msg>    a fetch served wrong KV (exit 3)

Usage: child_writer.py SSD_PATH LOG_PATH SEED [RAM_BUDGET_GB] [MODEL]
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvdata as D  # noqa: E402

from kvstore import PrefixStore  # noqa: E402


def main() -> None:
    path, log_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    budget = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0005
    model = sys.argv[5] if len(sys.argv) > 5 else "crash-model"
    log = open(log_path, "a", buffering=1)
    store = PrefixStore(budget_gb=budget, ssd_path=path, block_size=D.BLOCK)
    log.write("ready\n")
    rng = random.Random(seed)
    i = -1
    while True:
        i += 1
        toks = D.writer_prompt(seed, i)
        store.put(model, toks, D.layers_for(toks))
        if rng.random() < 0.4:
            log.write(f"F {i}\n")
            store.flush()
            log.write(f"D {i}\n")
        if i and rng.random() < 0.3:
            j = rng.randrange(i)
            other = D.writer_prompt(seed, j)
            why = D.hit_problem(store.fetch(model, other), other)
            if why:
                log.write(f"WRONG prompt {j}: {why}\n")
                sys.exit(3)


if __name__ == "__main__":
    main()
