"""What a new prompt shape costs mlx's CUDA backend, and whether a process
that meets many of them lives (issue 54, item 4):

    kvstore bench new-shapes --shapes 600 --out OUT/new-shapes.json

mlx builds a cuDNN attention graph per exact q/k/v shape and keeps it in an
LRU cache whose lifetime misses past twice its size throw "Cache thrashing is
happening" (``kvstore.gpu.mlx_env``). For each setting of mlx's variables
(``SETTINGS``), in a fresh process each, ``--shapes`` distinct lengths in a
shuffled order through

* ``sdpa``: ``mx.fast.scaled_dot_product_attention`` alone, causal, q = k =
  the length, Llama-3-8B's heads (32 query, 8 KV, 128 wide), bfloat16;
* ``prefill``: a fixed-seed llama (mlx-lm's own ``Model``, ``--hidden`` wide,
  ``--layers`` deep, bfloat16) prefilling a prompt of that length from an
  empty cache, as a server's prefill does.

Reports per setting whether the process lived through every shape (else at
which one it failed, and the error), the median and p90 milliseconds of a
shape's first call and the median of the same shape again (every
``--repeat-every``-th), and a digest of each output (the attention output's
bits; the last position's logits and the greedy next token), compared with
the first setting's: ``outputs_equal`` is the share of shapes whose bits are
the same. Needs mlx's CUDA backend (elsewhere every setting runs, and nothing
is thrown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"
# Each setting's variables, set before the child starts (the check's value stated each time: importing kvstore
# sets it to 0 where it is not set). "check-off-late" turns the check off after mlx has run its first kernel and
# before the first attention: whether mlx reads it when the attention cache is made, or at the backend's start.
SETTINGS = {
    "mlx-default": {CHECK: "1"},
    "check-off": {CHECK: "0"},
    "sdpa-cache-4096": {CHECK: "1", "MLX_CUDA_SDPA_CACHE_SIZE": "4096"},
    "cudnn-off": {CHECK: "1", "MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "check-off-late": {CHECK: "1"},
}
OUR_VARS = (CHECK, "MLX_CUDA_SDPA_CACHE_SIZE", "MLX_CUDA_USE_CUDNN_SDPA")


def lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``n`` distinct lengths in ``[low, high)``, shuffled (the order a server meets them in)."""
    return [int(x) for x in np.random.default_rng(seed).choice(np.arange(low, high), n, replace=False)]


def _digest(a) -> str:
    import mlx.core as mx
    import xxhash

    bits = a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a
    return xxhash.xxh3_64_hexdigest(np.array(bits).tobytes())


def _timed(fn) -> tuple[float, object]:
    import mlx.core as mx

    t = time.perf_counter()
    out = fn()
    mx.eval(out)
    return (time.perf_counter() - t) * 1e3, out


def _sdpa_case(args):
    import mlx.core as mx

    heads, kv_heads, dim = 32, 8, 128

    def case(n: int):
        k1, k2, k3 = mx.random.split(mx.random.key(n), 3)
        q = mx.random.normal((1, heads, n, dim), key=k1).astype(mx.bfloat16)
        k = mx.random.normal((1, kv_heads, n, dim), key=k2).astype(mx.bfloat16)
        v = mx.random.normal((1, kv_heads, n, dim), key=k3).astype(mx.bfloat16)
        mx.eval(q, k, v)

        def run():
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask="causal")

        return run, lambda o: {"digest": _digest(o)}

    return case


def _prefill_case(args):
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    heads = args.hidden // 128
    margs = llama.ModelArgs(model_type="llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=args.hidden * 11 // 4, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 2), head_dim=128, rms_norm_eps=1e-5,
                            vocab_size=32000, rope_theta=500000.0, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(margs)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())

    def case(n: int):
        ids = mx.array(np.random.default_rng(n).integers(0, margs.vocab_size, n), dtype=mx.int32)[None]
        mx.eval(ids)

        def run():
            return model(ids, cache=make_prompt_cache(model))[0, -1]

        return run, lambda logits: {"digest": _digest(logits), "next": int(mx.argmax(logits).item())}

    return case


def child(args) -> None:
    """One setting in this process: every shape, the results written to ``args.result`` as they come."""
    import mlx.core as mx

    mx.eval(mx.ones(8) + 1)  # the backend is up: streams, encoders, the CUDA graph cache
    if args.setting == "check-off-late":
        os.environ[CHECK] = "0"
    case = (_sdpa_case if args.part == "sdpa" else _prefill_case)(args)
    out = {"part": args.part, "setting": args.setting, "device": str(mx.default_device()),
           "env": {k: os.environ.get(k) for k in OUR_VARS}, "done": 0, "shapes": []}

    def write():
        Path(args.result).write_text(json.dumps(out))

    run, _ = case(16)  # a length not in the list: cuDNN's and the kernels' first use
    _timed(run)
    t0 = time.monotonic()
    for i, n in enumerate(lengths(args.shapes, args.low, args.high)):
        if time.monotonic() - t0 > args.budget_s:
            out["stopped"] = f"time budget of {args.budget_s} s spent"
            break
        run, describe = case(n)
        try:
            new_ms, o = _timed(run)
            row = {"n": n, "new_ms": round(new_ms, 3), **describe(o)}
            if i % args.repeat_every == 0:
                row["again_ms"] = round(_timed(run)[0], 3)
        except Exception as e:  # mlx raises what its C++ side threw
            out["error"] = {"at": i, "n": n, "message": str(e)[:300]}
            write()
            break
        out["shapes"].append(row)
        out["done"] = i + 1
        if i % 50 == 0:
            write()
    out["max_rss_mb"] = _max_rss_mb()
    out["peak_memory_mb"] = round(mx.get_peak_memory() / 2**20, 1)
    write()


def _max_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.quantile(values, q)), 2) if values else None


def summarize(res: dict, first: dict | None) -> dict:
    rows = res.get("shapes", [])
    new = [r["new_ms"] for r in rows]
    again = [r["again_ms"] for r in rows if "again_ms" in r]
    s = {"setting": res["setting"], "env": res.get("env"), "shapes_done": res.get("done", 0),
         "survived": "error" not in res and res.get("returncode") == 0 and not res.get("stopped"),
         "new_ms_median": _ms(new, 0.5), "new_ms_p90": _ms(new, 0.9), "again_ms_median": _ms(again, 0.5),
         "new_minus_again_ms": round(statistics.median(new) - statistics.median(again), 2) if new and again else None,
         "max_rss_mb": res.get("max_rss_mb"), "peak_memory_mb": res.get("peak_memory_mb")}
    for k in ("error", "stopped", "stderr_tail"):
        if res.get(k):
            s[k] = res[k]
    if first is not None and first is not res:
        theirs = {r["n"]: r for r in first.get("shapes", [])}
        both = [(r, theirs[r["n"]]) for r in rows if r["n"] in theirs]
        s["compared_with"] = first["setting"]
        s["compared_shapes"] = len(both)
        s["outputs_equal"] = round(sum(a["digest"] == b["digest"] for a, b in both) / len(both), 4) if both else None
        if both and "next" in rows[0]:
            s["next_token_equal"] = round(sum(a["next"] == b["next"] for a, b in both) / len(both), 4)
    return s


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvstore bench new-shapes", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=["sdpa", "prefill"], default=["sdpa", "prefill"])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="the first is the one outputs are compared with")
    ap.add_argument("--shapes", type=int, default=600, help="distinct lengths per setting (default 600)")
    ap.add_argument("--low", type=int, default=32)
    ap.add_argument("--high", type=int, default=4096, help="lengths drawn from [low, high)")
    ap.add_argument("--repeat-every", type=int, default=4, help="time every N-th shape a second time (default 4)")
    ap.add_argument("--hidden", type=int, default=1024, help="prefill: the llama's width (heads of 128)")
    ap.add_argument("--layers", type=int, default=8, help="prefill: its layers")
    ap.add_argument("--budget-s", type=float, default=120, help="seconds of shapes a setting may take (default 120)")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no setting after this many seconds")
    ap.add_argument("--out", default="new-shapes.json")
    ap.add_argument("--child", nargs=2, metavar=("PART", "SETTING"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _run_setting(args, part: str, setting: str, tmp: Path) -> dict:
    result = tmp / f"{part}-{setting}.json"
    env = {k: v for k, v in os.environ.items() if k not in OUR_VARS}
    env.update(SETTINGS[setting])
    cmd = [sys.executable, "-m", "kvstore.tools.bench.new_shapes", "--child", part, setting, "--result", str(result),
           "--shapes", str(args.shapes), "--low", str(args.low), "--high", str(args.high),
           "--repeat-every", str(args.repeat_every), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--budget-s", str(args.budget_s)]
    t = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.budget_s + 45)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    res = json.loads(result.read_text()) if result.exists() else {"part": part, "setting": setting, "done": 0}
    res["returncode"] = rc
    res["wall_s"] = round(time.monotonic() - t, 1)
    if rc != 0:
        res["stderr_tail"] = (err or "")[-600:]
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        args.part, args.setting = args.child
        child(args)
        return 0
    start = time.monotonic()
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "result")}, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="new-shapes-") as tmp:
        for part in args.parts:
            raw = []
            for setting in args.settings:
                if args.deadline_s and time.monotonic() - start > args.deadline_s:
                    break
                raw.append(_run_setting(args, part, setting, Path(tmp)))
                print(json.dumps(summarize(raw[-1], raw[0])), flush=True)
            out["parts"][part] = {"summary": [summarize(r, raw[0]) for r in raw],
                                  "device": raw[0].get("device") if raw else None,
                                  "shapes": {r["setting"]: r.get("shapes", []) for r in raw}}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
