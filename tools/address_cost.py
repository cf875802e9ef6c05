"""What taking an mlx array's address costs on CUDA (why hits land in a reused buffer).

mlx keeps what its kernels make in device memory and moves an array into
managed memory, with a copy, the first time its address is taken. This makes
4 GiB of fresh arrays, takes their addresses (``kvstore.gpu.cuda.address``, the
buffer protocol) twice, and has a kernel read them; then the same from mlx's
buffer cache (arrays moved before), and fresh again. Run on
the device machine::

    python3 -m kvstore.tools.address_cost --out OUT/address.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvstore.tools.bench.common import write_json


def run(gib: int) -> dict:
    import mlx.core as mx

    from kvstore.gpu import cuda

    def ms(t0: float) -> float:
        mx.synchronize()
        return round(1e3 * (time.perf_counter() - t0), 1)

    rows = []
    for fresh in (True, False, True):
        if fresh:
            mx.clear_cache()
        mx.synchronize()
        t = time.perf_counter()
        xs = [mx.zeros((1 << 30,), mx.uint8) for _ in range(gib)]
        mx.eval(xs)
        made = ms(t)
        t = time.perf_counter()
        addrs = [cuda.address(x) for x in xs]
        first = ms(t)
        t = time.perf_counter()
        again = [cuda.address(x) for x in xs]
        twice = ms(t)
        t = time.perf_counter()
        mx.eval([mx.sum(x.view(mx.uint32)) for x in xs])
        read = ms(t)
        rows.append({"fresh": fresh, "make_ms": made, "first_address_ms": first, "address_again_ms": twice,
                     "kernel_read_ms": read, "moved_once": addrs == again})
        print(json.dumps(rows[-1]), flush=True)
        del xs
    return {"gib": gib, "device": str(mx.default_device()), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    write_json(args.out, run(args.gib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
