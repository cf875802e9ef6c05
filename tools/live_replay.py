"""Issue 42's live replay: interleaved chat and agent sessions on two shared
system prompts, through the public API as an engine uses it, each cache in a
fresh process under the same memory; on a CPU box with the tiny llama, or on
a GPU with the 8B-shaped llama of ``--make-model``.

    python -m kvstore.tools.live_replay --model PATH|tiny --trace gpu45|gpu|cpu|smoke \\
        --systems none lru kvstore_fp16 kvstore_q8 --budgets 0.25 0.10 --out DIR [--fresh-process] [--warm]
        [--ssd [--ssd-admit always|reuse]] [--profile] [--switch-interval S] [--idle-writer]
    python -m kvstore.tools.live_replay --make-model --model /tmp/llama-8b     # the 8B-shaped llama, then stop
    python -m kvstore.tools.live_replay serve --model PATH|tiny --trace gpu --clients 8 --out DIR
    python -m kvstore.tools.live_replay compare DIR_A DIR_B    # every request's tokens, run by run: a change's check

The traces are ``tools/bench/live_traces.py``'s (``make_trace`` settings:
"gpu45" is docs/benchmarks.md's H200 replay table, "gpu" its servers' run).
Caches, with B = budget x the trace's unique KV (fp16 bytes): ``none``,
mlx-lm's ``LRUPromptCache(max_bytes=B)``, ``PrefixStore`` fp16 / q8 with
``budget_gb`` = ``device_budget_gb`` = B (``tools/bench/live_run.py`` times
each request). ``--warm``: each run again on a second new cache of the same
process (``warm_run``), every system alike: mlx builds its kernels once per
shape, and the second round shows what that set-up was.

The parent runs each (cache, budget) as ``--one CACHE:BUDGET`` in a child
process (``--fresh-process``; without it one child runs them all in turn) and
never loads the model itself; it writes ``replay-CACHE-BUDGET.json`` per run,
``summary.json`` (``tools/bench/live_summary.py``: ratios, floors, the issue's
checks) and prints a table. ``serve``: the same trace as text through
``mlx_lm.server`` and ``kvstore serve`` (``tools/bench/live_serve.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from kvstore.tools.bench.common import log
from kvstore.tools.bench.live_summary import SYSTEMS, run_name, summarize, table
from kvstore.tools.bench.live_traces import TRACES


def parent(a: argparse.Namespace) -> int:
    """Each (cache, budget) in a child process, then the summary of their JSON."""
    jobs = (["none"] if "none" in a.systems else []) + [f"{s}:{f:g}" for f in a.budgets for s in a.systems if s != "none"]
    common = ["--model", a.model, "--trace", a.trace, "--out", str(a.out), "--dir", str(a.dir)] + \
        ["--warm"] * a.warm + ["--ssd"] * a.ssd + ["--ssd-admit", a.ssd_admit] + ["--profile"] * a.profile + \
        ["--idle-writer"] * a.idle_writer + ([] if a.switch_interval is None else
                                             ["--switch-interval", str(a.switch_interval)])
    groups = [[j] for j in jobs] if a.fresh_process else [jobs]
    for g in groups:
        log(f"process for {' '.join(g)}")
        subprocess.run([sys.executable, "-m", "kvstore.tools.live_replay", "--one", *g, *common], check=True)
    runs = {}
    for j in jobs:
        system, _, frac = j.partition(":")
        name = run_name(system, float(frac or 0))
        runs[name] = json.loads((a.out / f"replay-{name}.json").read_text())
    summary = summarize(runs)
    first = next(iter(runs.values()))
    summary.update(trace=first["trace"], model=first["model"], device=first["device"], machine=first["machine"],
                   fresh_process=a.fresh_process, warm=a.warm, ssd=a.ssd, targets_note=
                   "the issue's targets hold for an H200 and the 8B shape; on a CPU with the tiny llama they are "
                   "reported, not expected")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    return 0


def _serve_args(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16, help="cap on each response (the trace's length below)")
    ap.add_argument("--budget-frac", type=float, default=0.25)
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "compare":
        from kvstore.tools.bench.live_summary import compare

        cp = argparse.ArgumentParser(prog="live_replay compare", description=compare.__doc__)
        cp.add_argument("first", type=Path)
        cp.add_argument("second", type=Path)
        c = cp.parse_args(argv[1:])
        return compare(c.first, c.second)
    ap = argparse.ArgumentParser(prog="live_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="an mlx-lm model folder, or 'tiny' (the tiny llama)")
    ap.add_argument("--trace", choices=sorted(TRACES), default="cpu")
    if argv and argv[0] == "serve":
        from kvstore.tools.bench.live_serve import serve

        ap.add_argument("--out", type=Path, required=True)
        return serve(_serve_args(ap, argv[1:]))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--make-model", action="store_true", help="write the 8B-shaped llama at --model and stop")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.1], help="shares of the unique KV")
    ap.add_argument("--fresh-process", action="store_true", help="each (cache, budget) in a process of its own "
                    "(else one child process runs them in turn)")
    ap.add_argument("--warm", action="store_true", help="each run again on a second new cache of the same process")
    ap.add_argument("--ssd", action="store_true", help="kvstore: an SSD tier under --dir")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/live-replay"), help="scratch folder (SSD tiers)")
    ap.add_argument("--ssd-admit", choices=["always", "reuse"], default="always",
                    help="kvstore with --ssd: write every block to SSD, or only blocks asked for again")
    ap.add_argument("--profile", action="store_true", help="kvstore: a cProfile of the first round's fetches "
                    "in the run's JSON (fetch_profile)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in each replay's process (seconds; Python's default 0.005): how much of "
                         "the engine's time goes to waiting for the interpreter while the store's threads work")
    ap.add_argument("--idle-writer", action="store_true",
                    help="flush after each put, untimed: each request runs with the store's writer idle (a diagnosis)")
    ap.add_argument("--one", nargs="+", metavar="CACHE[:BUDGET]", help=argparse.SUPPRESS)
    ap.add_argument("--budget-frac", type=float, default=0.25, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.make_model:
        from kvstore.tools.bench.llama_8b import make_model

        make_model(Path(a.model))
        return 0
    if a.out is None:
        ap.error("--out is required")
    if a.one:
        from kvstore.tools.bench.live_run import run_jobs

        return run_jobs(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
