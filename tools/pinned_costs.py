"""What page-locked host memory costs on this CUDA machine (issue 28).

The RAM tier's blocks live in ``cudaHostAlloc`` memory on CUDA. This times,
per GiB: allocating it, freeing it on an idle GPU, and whether a free on
another thread holds up the GPU work the engine's thread queues meanwhile (a
stand-in forward: a chain of matmuls timed with and without a concurrent
free). Run on the device machine::

    python3 -m kvstore.tools.pinned_costs --gib 1 4 --out OUT/pinned.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from kvstore.tools.bench.common import write_json


def _forward(mx, x, w, steps: int) -> float:
    t = time.perf_counter()
    y = x
    for _ in range(steps):
        y = y @ w
    mx.eval(y)
    mx.synchronize()
    return time.perf_counter() - t


def run(gibs: list[float], repeats: int) -> dict:
    import mlx.core as mx

    from kvstore.gpu import cuda
    rt = cuda.runtime()
    if rt is None:
        raise SystemExit("no CUDA runtime: this measures page-locked memory on CUDA only")
    x = mx.random.normal((4096, 4096)).astype(mx.float16)
    w = (mx.random.normal((4096, 4096)) / 64).astype(mx.float16)
    mx.eval(x, w)
    _forward(mx, x, w, 50)
    out: dict = {"device": str(mx.default_device()), "rows": []}
    for gib in gibs:
        n = int(gib * (1 << 30))
        row: dict = {"gib": gib, "alloc_s": [], "touch_s": [], "free_idle_s": [], "forward_alone_s": [],
                     "forward_during_free_s": [], "free_during_forward_s": [], "forward_during_alloc_s": []}
        for _ in range(repeats):
            t = time.perf_counter()
            a = rt.pinned(n)
            row["alloc_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            a[::4096] = 1
            row["touch_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            del a  # the last view: cudaFreeHost here
            row["free_idle_s"].append(time.perf_counter() - t)
            row["forward_alone_s"].append(_forward(mx, x, w, 200))
            b = rt.pinned(n)
            b[::4096] = 1
            freed: list[float] = []

            def free():
                nonlocal b
                time.sleep(0.002)  # after the forward's kernels are queued
                t0 = time.perf_counter()
                b = None
                freed.append(time.perf_counter() - t0)
            th = threading.Thread(target=free)
            th.start()
            row["forward_during_free_s"].append(_forward(mx, x, w, 200))
            th.join()
            row["free_during_forward_s"].append(freed[0])
            made: list = []

            def alloc():
                time.sleep(0.002)
                made.append(rt.pinned(n))
            th = threading.Thread(target=alloc)
            th.start()
            row["forward_during_alloc_s"].append(_forward(mx, x, w, 200))
            th.join()
            made.clear()
        for k in [k for k in row if k.endswith("_s")]:
            times = row.pop(k)
            row[k[:-2] + "_ms"] = [round(v * 1e3, 2) for v in times]
            row[k[:-2] + "_ms_median"] = round(statistics.median(times) * 1e3, 2)
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k.endswith("median") or k == "gib"}), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res = run(args.gib, args.repeats)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
