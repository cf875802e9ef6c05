"""Quick figures for the core: bytes per token of a Llama-3-8B-shaped layer set
(32 layers, 8 KV heads, head dim 128) for fp16 / 8-bit / 4-bit entries, and the
time of `fetch` for a 32K-token prompt with every block in RAM and on SSD.

    python tools/core_figures.py [--tokens 32768] [--layers 32] [--repeats 3]
"""

import argparse
import statistics
import tempfile
import time

import mlx.core as mx

from kvstore import KVLayer, PrefixStore


def layers(n, n_layers, heads=8, dim=128):
    mx.random.seed(0)
    base = mx.random.normal((1, heads, n, dim)).astype(mx.float16)
    out = [KVLayer(base * (1 + 0.01 * i), base * (1 - 0.01 * i)) for i in range(n_layers)]
    mx.eval([a for l in out for a in (l.keys, l.values)])
    return out


def timed(fn, repeats):
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bits", default="none,8,4")
    a = ap.parse_args()
    n = a.tokens
    kv = layers(n, a.layers)
    tokens = list(range(n))
    print(f"{n} tokens, {a.layers} layers x 8 KV heads x 128 dims")
    print("| entries | bytes/token | vs fp16 | put blocks caller (ms) | fetch RAM (s) | GB/s | fetch SSD page-cached (s) | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    fp16 = None
    for b in a.bits.split(","):
        bits = None if b == "none" else int(b)
        with tempfile.TemporaryDirectory() as d:
            store = PrefixStore(budget_gb=16, ssd_path=d, kv_bits=bits, disk_budget_gb=32)
            t = time.perf_counter()
            store.put("m", tokens, kv)
            put_ms = 1000 * (time.perf_counter() - t)
            store.flush()
            per_tok = store.nbytes / n
            fp16 = fp16 or per_tok
            out_bytes = n * a.layers * 2 * 8 * 128 * 2  # what fetch hands back: fp16 arrays
            ram = timed(lambda: store.fetch("m", tokens), a.repeats)
            store.close()
            def ssd():
                s = PrefixStore(budget_gb=0, ssd_path=d)
                s.fetch("m", tokens)
                s.close()
            ssd()  # page the file in once
            disk = timed(ssd, a.repeats)
            print(f"| {b} | {per_tok:.0f} | {fp16 / per_tok:.2f}x | {put_ms:.2f} | {ram:.3f} | {out_bytes / ram / 1e9:.2f} "
                  f"| {disk:.3f} | {out_bytes / disk / 1e9:.2f} |")


if __name__ == "__main__":
    main()
