"""Issues 42 and 54's live replay: interleaved chat and agent sessions on two shared system prompts,
through the public API as an engine uses it, each cache on a new store under the same memory; on a CPU
box with the tiny llama, or on a GPU with the 8B-shaped llama of ``--make-model``.

    python -m kvstore.tools.live_replay --model PATH|tiny --trace gpu45|gpu|cpu|smoke \\
        --systems none lru kvstore_fp16 kvstore_q8 --budgets 0.25 0.10 --out DIR [--fresh-process]
        [--rounds fresh warm-engine] [--ssd [--drop-page-cache [fadvise|drop_caches]] [--ssd-admit always|reuse]]
        [--warm] [--warm-up-cache same|none] [--warm-up-requests N] [--profile] [--switch-interval S] [--idle-writer]
    python -m kvstore.tools.live_replay --make-model --model /tmp/llama-8b     # the 8B-shaped llama, then stop
    python -m kvstore.tools.live_replay serve --model PATH|tiny --trace gpu --clients 8 --out DIR
    python -m kvstore.tools.live_replay compare DIR_A DIR_B    # every request's tokens, run by run: a change's check
    python -m kvstore.tools.live_replay summary DIR [DIR ...] [--out DIR]   # one summary of several invocations

The traces are ``tools/bench/live_traces.py``'s (``make_trace`` settings: "gpu45" is docs/benchmarks.md's
H200 replay table, "gpu" its servers' run). Caches, with B = budget x the trace's unique KV (fp16 bytes):
``none``, mlx-lm's ``LRUPromptCache(max_bytes=B)``, ``PrefixStore`` fp16 / q8 with ``budget_gb`` =
``device_budget_gb`` = B (``tools/bench/live_run.py`` times each request).

Rounds (``--rounds``; each run is a new cache, its SSD tier a new folder): ``fresh``, the replay first
thing in a new process (each (cache, budget) in a process of its own with ``--fresh-process``, else
one child runs them in turn; ``--warm``: each again on a second new cache of that process,
``warm_run``); ``warm-engine``, always a process per run: the engine first warmed on another trace
(``warm_up_trace``: every length shifted, no prompt length of the measured trace) through a cache of
the same kind, thrown away (``--warm-up-cache``), then the measured replay on a new cache: a server
that has served other traffic. ``--drop-page-cache`` (with ``--ssd``): each kvstore run once more,
its store's file dropped from the page cache before every request (``tools/bench/page_cache.py``),
so its SSD hits are priced at the disk: the store is new in every round, so a single drop before the
round would find nothing to drop. The ``none`` runs replay their prefills again after the round
(``repeat_prefill_s``): the engine's steady rate and its cost of a new shape, the floor's terms
(``tools/bench/live_summary.py``).

The parent never loads the model itself; it writes ``replay-RUN.json`` per run (``run_key``:
``kvstore_q8-0.1@warm-engine+ssd+dropped``), ``summary.json`` (ratios, floors, the issues' checks) and
prints the tables. ``serve``: the same trace as text through ``mlx_lm.server`` and ``kvstore serve``
(``tools/bench/live_serve.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from kvstore.tools.bench.common import log
from kvstore.tools.bench.live_summary import ROUNDS, SYSTEMS, run_key, summarize, table
from kvstore.tools.bench.live_traces import TRACES


def parent(a: argparse.Namespace) -> int:
    """Each run in a child process (``--rounds``, ``--fresh-process``), then the summary of their JSON."""
    jobs = (["none"] if "none" in a.systems else []) + [f"{s}:{f:g}" for f in a.budgets for s in a.systems
                                                         if s != "none"]
    if a.drop_page_cache:
        jobs += [f"{j}:dropped" for j in jobs if j.startswith("kvstore")]
    common = ["--model", a.model, "--trace", a.trace, "--out", str(a.out), "--dir", str(a.dir)] + \
        ["--warm"] * a.warm + ["--ssd"] * a.ssd + ["--ssd-admit", a.ssd_admit] + ["--profile"] * a.profile + \
        ["--idle-writer"] * a.idle_writer + ["--warm-up-cache", a.warm_up_cache] + \
        ["--warm-up-requests", str(a.warm_up_requests)] + \
        ([] if a.drop_page_cache is None else ["--drop-page-cache", a.drop_page_cache]) + \
        ([] if a.switch_interval is None else
                                                             ["--switch-interval", str(a.switch_interval)])
    files = []
    for rnd in a.rounds:
        groups = [[j] for j in jobs] if a.fresh_process or rnd != "fresh" else [jobs]
        for g in groups:
            log(f"process for {' '.join(g)} ({rnd})")
            subprocess.run([sys.executable, "-m", "kvstore.tools.live_replay", "--one", *g, "--round", rnd, *common],
                           check=True)
        for j in jobs:
            system, _, rest = j.partition(":")
            frac, _, variant = rest.partition(":")
            key = run_key(system, float(frac or 0), rnd, variant == "dropped", a.ssd and system.startswith("kvstore"))
            files.append(a.out / f"replay-{key}.json")
    return write_summary(files, a.out, fresh_process=a.fresh_process, rounds=a.rounds, warm=a.warm, ssd=a.ssd,
                         drop_page_cache=a.drop_page_cache)


def write_summary(files: list[Path], out: Path, **settings) -> int:
    """``summary.json`` in ``out`` of the runs in ``files`` (``replay-RUN.json``), and its tables printed."""
    runs = {f.stem.removeprefix("replay-"): json.loads(f.read_text()) for f in files}
    summary = summarize(runs)
    first = next(iter(runs.values()))
    summary.update(trace=first["trace"], model=first["model"], device=first["device"], machine=first["machine"],
                   ssd_fs=next((r["ssd_fs"] for r in runs.values() if r.get("ssd_fs")), None), **settings,
                   targets_note="the issues' targets hold for an H200 or H100 and the 8B shape; on a CPU with the "
                   "tiny llama they are reported, not expected")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
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
    if argv and argv[0] == "summary":
        sp = argparse.ArgumentParser(prog="live_replay summary", description=write_summary.__doc__)
        sp.add_argument("dirs", nargs="+", type=Path, help="folders of replay-RUN.json (a run in several: the last's)")
        sp.add_argument("--out", type=Path, help="where summary.json goes (default: the first folder)")
        c = sp.parse_args(argv[1:])
        files = {f.name: f for d in c.dirs for f in sorted(d.glob("replay-*.json"))}
        return write_summary(list(files.values()), c.out or c.dirs[0], merged=[str(d) for d in c.dirs])
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
    ap.add_argument("--rounds", nargs="+", choices=ROUNDS, default=["fresh"],
                    help="fresh: the replay first thing in a new process; warm-engine: a process per run, the "
                         "engine warmed on another trace first")
    ap.add_argument("--warm", action="store_true", help="fresh round: each run again on a second new cache of the "
                    "same process")
    ap.add_argument("--warm-up-cache", choices=["same", "none"], default="same",
                    help="warm-engine: the warm-up through a cache of the measured kind (thrown away), or none")
    ap.add_argument("--warm-up-requests", type=int, default=0, help="warm-engine: the warm-up trace's first N "
                    "requests only (0: all)")
    ap.add_argument("--ssd", action="store_true", help="kvstore: an SSD tier under --dir")
    ap.add_argument("--drop-page-cache", nargs="?", const="fadvise", choices=["fadvise", "drop_caches"],
                    help="with --ssd: each kvstore run once more, its store's file out of the page cache before every "
                         "request (fadvise; drop_caches: the machine's, as root)")
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
    ap.add_argument("--round", choices=ROUNDS, default="fresh", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.make_model:
        from kvstore.tools.bench.llama_8b import make_model

        make_model(Path(a.model))
        return 0
    if a.out is None:
        ap.error("--out is required")
    if a.drop_page_cache and not a.ssd:
        ap.error("--drop-page-cache needs --ssd (a store with a file to drop)")
    if a.one:
        from kvstore.tools.bench.live_run import run_jobs

        return run_jobs(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
