"""Options, the run of the chosen parts, and the JSON: ``DIR/<part>.json`` and
``DIR/results.json`` (``{"meta": ..., "parts": ...}``)."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import fidelity, lookup, plots, put, replay, report, restore, ttft
from .common import log, machine, mlx_speed
from .settings import PARTS, SIZES

RUNS = {"restore": restore.run, "lookup": lookup.run, "put": put.run, "ttft": ttft.run, "replay": replay.run,
        "fidelity": fidelity.run}
ROOT = Path(__file__).resolve().parents[2]  # the repository, in an editable install
# The benchmarks with options of their own: ``kvstore bench NAME [options]`` runs the module's ``main``
# (``kvstore bench NAME --help`` lists its options); docs/benchmarks.md has each one's command and tables.
BENCHES = {
    "ssd": ("kvstore.tools.bench.ssd", "the SSD tier at disk speed: fetch and put against plain reads and writes"),
    "cost": ("kvstore.tools.bench.cost", "TTFT of cold prefill, a forced hit and fetch_policy='auto', per source"),
    "calibration": ("kvstore.tools.bench.calibration", "what auto's calibration costs a model's first request"),
    "fingerprint": ("kvstore.tools.bench.fingerprint", "what keying a model by every byte of its files costs"),
    "evict": ("kvstore.tools.bench.evict", "the cost of one eviction against the number of blocks held"),
    "remote": ("kvstore.tools.bench.remote", "the remote tier (Redis / Valkey) over loopback"),
    "put-cost": ("kvstore.tools.put_cost", "what storing a cache blocks the engine's thread, through the adapters"),
    "fetch-path": ("kvstore.tools.bench.fetch_path", "one fetch on the engine's thread: modules, transitions, locks"),
    "gc-pauses": ("kvstore.tools.bench.gc_pauses", "the garbage collector's pauses during puts"),
    "new-shapes": ("kvstore.tools.bench.new_shapes", "CUDA: what a new prompt shape costs mlx, and whether 600 end a process"),
    "fidelity-text": ("kvstore.tools.fidelity", "fidelity of stored KV on a trained model and real text"),
    "run-ttft": ("kvstore.tools.bench.run_ttft", "an unchanged mlx-lm engine's first token under kvstore run"),
    "vllm-mlx-replay": ("kvstore.tools.bench.vllm_mlx_replay", "the multi-user replay through vllm-mlx's engine"),
    "vllm-mlx-ttft": ("kvstore.tools.bench.vllm_mlx_ttft", "TTFT through vllm-mlx's OpenAI server, its cache vs the store"),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvstore bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvstore's CPU suite (python -m kvstore.tools.bench, or kvstore bench; parts are described in "
                    "kvstore.tools.bench's docstring).",
        epilog="other benchmarks, each with options of its own (kvstore bench NAME --help):\n"
               + "\n".join(f"  {name:<16} {what}" for name, (_, what) in BENCHES.items()))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (< 5 min on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, for tests (seconds)")
    ap.add_argument("--only", nargs="+", choices=PARTS, metavar="PART", help=f"parts to run: {', '.join(PARTS)}")
    ap.add_argument("--out", default="bench-out", help="output folder for JSON and PNG (default: bench-out)")
    ap.add_argument("--repeats", type=int, help="repeats per measurement (default: mode's)")
    ap.add_argument("--tmp", help="where SSD stores and scratch files go (default: system temp)")
    ap.add_argument("--write-docs", action="store_true", help="write docs/benchmarks.md (default: full runs only)")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help=argparse.SUPPRESS)
    ap.add_argument("--merge", metavar="RESULTS_JSON",
                    help="take the parts not run now from an earlier results.json (its plots from its folder)")
    return ap.parse_args(argv)


def _merge(results: dict, meta: dict, plots_: list, merge: str, mode: str, out: Path) -> dict:
    """The parts not run now, from an earlier results.json (and its plots)."""
    prev = json.loads(Path(merge).read_text())
    for part, r in prev["parts"].items():
        if part not in results:
            results[part] = r
            meta["part_dates"][part] = prev["meta"].get("part_dates", {}).get(part, prev["meta"]["date"])
            for png in Path(merge).parent.glob(f"{part}.png"):
                if png.resolve() != (out / png.name).resolve():
                    shutil.copy(png, out / png.name)
                plots_.append(png.name)
    results = {p: results[p] for p in PARTS if p in results}
    meta["merged_from"] = str(merge)
    meta["mode"] = prev["meta"]["mode"] if mode == prev["meta"]["mode"] else f"{mode}+{prev['meta']['mode']}"
    meta["runtime_s"] = sum(r.get("runtime_s", 0) for r in results.values())
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in BENCHES:
        rc = importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])
        return rc if isinstance(rc, int) else 0  # some return their results
    args = parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    cfg = SIZES[mode]
    R = args.repeats or cfg["repeats"]
    parts = list(args.only) if args.only else list(PARTS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.tmp))
    import mlx_lm

    meta = {"mode": mode, "parts": parts, "repeats": R, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "python": platform.python_version(), "argv": argv,
            "mlx_speed": mlx_speed(cfg["machine"], R)}
    results: dict[str, Any] = {}
    pngs: list[str] = []
    t_all = time.perf_counter()
    try:
        for part in parts:
            t0 = time.perf_counter()
            log(f"== {part} ({mode})")
            r = RUNS[part](cfg, R, tmp)
            if part in plots.PLOTS:
                pngs += plots.PLOTS[part](r, out)
            r["runtime_s"] = time.perf_counter() - t0
            results[part] = r
            (out / f"{part}.json").write_text(json.dumps(r, indent=1, default=str))
            log(f"== {part} done in {r['runtime_s']:.1f} s")
            gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["runtime_s"] = time.perf_counter() - t_all
    meta["part_dates"] = {p: meta["date"] for p in results}
    if args.merge:
        results = _merge(results, meta, pngs, args.merge, mode, out)
    meta["plots"] = pngs
    (out / "results.json").write_text(json.dumps({"meta": meta, "parts": results}, indent=1, default=str))
    rows = report.summary_rows(results)
    if rows:
        print("| what | result | target | |\n|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    if (mode == "full" and not args.only) or args.write_docs:
        p = report.write_docs(results, meta, out, Path(args.docs))
        log(f"wrote {p}")
    log(f"total {meta['runtime_s']:.1f} s; results in {out}/")
    return 0
