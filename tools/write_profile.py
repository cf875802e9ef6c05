"""Where the background writer's time goes: one put of a prompt's KV run in
the calling thread under cProfile (encode, serialize, LMDB put, commit).

    python -m kvstore.tools.write_profile --tokens 8192 --kv q4 [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import PrefixStore
from kvstore.tools.ssd_bench import KV, _layers, add_shape_args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="write_profile", description=__doc__.split("\n\n")[0])
    add_shape_args(ap, tokens=8192)
    ap.add_argument("--out", type=Path, default=None, help="write write_profile.json here")
    args = ap.parse_args(argv)
    src = _layers(args.tokens, args.layers, args.heads, args.dim)
    res = {}
    for kind in args.kv:
        tmp = Path(tempfile.mkdtemp(prefix="write-profile-"))
        try:
            for rep in range(2):  # the first warms kernels and the file
                with PrefixStore(budget_gb=64, ssd_path=tmp / str(rep), kv_bits=KV[kind]) as s:
                    s._writer.max_pending = 0  # noqa: SLF001 -- a put past the bound runs in the caller
                    s._writer.pending_bytes = 1  # noqa: SLF001
                    prompt = np.arange(5 + rep, args.tokens + 5 + rep, dtype=np.int32)
                    prof = cProfile.Profile()
                    t = time.perf_counter()
                    prof.runcall(s.put, "bench", prompt, src)
                    secs = time.perf_counter() - t
                    stored = s.stats()["ssd_bytes"]
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            lines = [l for l in out.getvalue().splitlines() if l.strip()][-15:]
            res[kind] = {"seconds": secs, "stored_bytes": stored, "GBps": stored / secs / 1e9, "profile": lines}
            print(kind, f"{stored / secs / 1e9:.2f} GB/s (profiled)", *lines, sep="\n", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "write_profile.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
