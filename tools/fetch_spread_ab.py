"""A/B of `fetch` with layers spread over the CPU's cores vs on one thread.

Puts a Llama-3-8B-shaped layer set (32 layers x 8 KV heads x 128) of
``--tokens`` fp16 tokens into a RAM-only store, then fetches it ``--rounds``
times per path, alternating the order; prints each time and the medians. The
first fetch of a process is reported apart (first touch of fresh memory).

    python tools/fetch_spread_ab.py [--tokens 32768] [--rounds 4]
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from kvstore import KVLayer, PrefixStore
from kvstore.convert import spread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    T = args.tokens
    mx.random.seed(0)
    base = mx.random.normal((1, 8, T, 128)).astype(mx.float16)
    layers = [KVLayer(base * (1 + 0.01 * i), base * (1 - 0.01 * i)) for i in range(args.layers)]
    mx.eval([a for l in layers for a in (l.keys, l.values)])
    nbytes = sum(l.nbytes for l in layers)
    toks = np.arange(T, dtype=np.int32)
    store = PrefixStore(budget_gb=nbytes * 1.5 / 2**30)
    store.put("m", toks, layers)
    store.flush()
    del layers
    paths = {"spread": spread.workers(), "one thread": 1}  # threads a fetch may use

    def fetch(name):
        spread.set_max_workers(paths[name])
        t = time.perf_counter()
        hit = store.fetch("m", toks)
        dt = time.perf_counter() - t
        assert hit.length == T
        return dt

    print(f"first fetch of the process: {fetch('spread'):.2f} s")
    times = {n: [] for n in paths}
    for r in range(args.rounds):
        for name in (paths if r % 2 == 0 else reversed(list(paths))):
            times[name].append(fetch(name))
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    spread.set_max_workers(paths["spread"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"median {name}: {m:.2f} s = {nbytes / m / 1e9:.2f} GB/s ({nbytes / 2**30:.1f} GiB)")
    store.close()


if __name__ == "__main__":
    main()
