"""How host bytes reach mlx arrays on the GPU, and back (run on a CUDA machine).

mlx keeps arrays in CUDA managed memory and offers no host->device copy, so
the route decides the speed. Each route moves the same bytes and is timed
until a kernel has read them on the GPU (or the host has read them back):

- ``fault``: ``mx.array(numpy)``, then the first kernel faults pages over.
- ``prefetch``: ``mx.array(numpy)``, then ``cudaMemPrefetchAsync`` (kvstore.gpu.cuda).
- ``assign``: ``dst[..., :n] = mx.array(numpy)`` into a device-resident buffer.
- ``d2h_fault`` / ``d2h_prefetch``: a GPU-computed array read by numpy,
  without / with a prefetch to the host first.
- baselines: ``memcpy`` (numpy copy of the same bytes), and torch's pinned
  and pageable host->device copies when torch is installed.

    python -m kvstore.tools.gpu_routes --mib 1024 --repeats 5 --out routes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from kvstore.gpu import cuda


def _time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        out.append(fn())
    return statistics.median(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    n = args.mib << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).view(np.float16)
    rt = cuda.runtime()
    res: dict = {"mib": args.mib, "device": str(mx.default_device()), "mlx": mx.__version__,
                 "cuda_runtime": rt.version if rt else None,
                 "concurrent_managed": rt.concurrent_managed if rt else None}

    def first_use(a):
        mx.eval(a[:1] + 0)  # a kernel that touches the array's first page
        mx.eval((a.reshape(-1, 4096)[:, :1] + 0))  # and one element of every 8 KiB: every page
        mx.synchronize()

    def memcpy():
        t = time.perf_counter()
        _ = src.copy()
        return time.perf_counter() - t

    def upload(prefetch: bool):
        t = time.perf_counter()
        a = mx.array(src)
        mx.eval(a)
        if prefetch:
            cuda.to_device([a])
        first_use(a)
        return time.perf_counter() - t

    def host_array_only():
        t = time.perf_counter()
        a = mx.array(src)
        mx.eval(a)
        return time.perf_counter() - t

    dst = mx.zeros((n // 2 + 4096,), mx.float16)
    mx.eval(dst)

    def assign():
        t = time.perf_counter()
        m = mx.array(src)
        dst[: n // 2] = m
        mx.eval(dst)
        first_use(dst)
        return time.perf_counter() - t

    def make_device():
        a = (mx.array(src[: 1 << 20]).reshape(1, -1) + mx.zeros((n // (2 << 20), 1), mx.float16)).reshape(-1)
        mx.eval(a)
        mx.synchronize()
        return a

    def d2h_fault():
        a = make_device()
        t = time.perf_counter()
        _ = np.array(a, copy=True)
        return time.perf_counter() - t

    def d2h_prefetch():
        a = make_device()
        t = time.perf_counter()
        cuda.to_host([a])
        _ = np.array(a, copy=True)
        return time.perf_counter() - t

    routes = {"memcpy": memcpy, "host_array_only": host_array_only,
              "fault": lambda: upload(False), "prefetch": lambda: upload(True),
              "assign": assign, "d2h_fault": d2h_fault, "d2h_prefetch": d2h_prefetch}
    for name, fn in routes.items():
        try:
            fn()  # warm
            s = _time(fn, args.repeats)
            res[name] = {"s": s, "GBps": n / s / 1e9}
        except Exception as e:  # a route mlx or the runtime refuses here
            res[name] = {"error": repr(e)}
        print(name, res[name], flush=True)
    try:
        import torch
        if torch.cuda.is_available():
            for pinned in (True, False):
                h = torch.from_numpy(src.view(np.uint8)).clone()
                if pinned:
                    h = h.pin_memory()
                d = torch.empty_like(h, device="cuda")

                def tcopy():
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    d.copy_(h, non_blocking=pinned)
                    torch.cuda.synchronize()
                    return time.perf_counter() - t
                tcopy()
                s = _time(tcopy, args.repeats)
                res["torch_" + ("pinned" if pinned else "pageable")] = {"s": s, "GBps": n / s / 1e9}
                print("torch", pinned, res["torch_" + ("pinned" if pinned else "pageable")], flush=True)
    except ImportError:
        pass
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
