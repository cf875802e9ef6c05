"""TTFT of cold prefill, a forced hit and ``fetch_policy="auto"``, per row of
prompt length x entry type x where the prefix is (RAM, SSD page-cached, SSD
cold), measured in one run.

    kvstore bench cost [--model PATH] [--lengths 1024 4096] [--out DIR]

Without ``--model`` it builds the fixed-seed tiny llama (CPU-sized); on a GPU
machine pass ``--model`` an mlx-lm folder (e.g. an 8B-shaped random-weight
llama). Each TTFT is the median of ``--repeats`` requests through
``kvstore.adapters.generate.generate`` (one generated token), the three
policies' requests interleaved so that each follows each equally often
(``request_order``):

- cold: ``fetch_policy="never"`` (everything prefilled);
- forced: ``"always"`` (every stored token loaded);
- auto: ``"auto"``, after the store has measured its rates in the same run
  (the cold and forced requests are its observations).

SSD-cold requests each reopen the store after its file is dropped from the
page cache (pages a live store has mapped cannot be dropped); the learned
rates carry over, as they do across any restart.

``--fresh``: every request is instead the first of a store that has measured
nothing (``remember_rates=False``: nothing loaded or saved) and of an engine
that has served nothing through it: the prefix is put from a prefill made
outside ``generate`` (so no prefill was observed), a RAM row's store is a new
RAM-only one holding it, an SSD row's is reopened on the file. Opening probes
the load-rate priors (``open_ms``); auto then calibrates the model once
(``calibrate_ms``: set-up, as the server does it at load; not in TTFT), and
the row records what it weighed (``auto_weighed``) and, per request, the
time spent in ``store.fetch`` (``*_fetch_each_ms``; the rest of a TTFT is
the engine's). Every request, of
every policy, follows the same set-up on the GPU: the calibration prefills
(for never/always on a store of their own, not the one timed) and then
mlx's buffer cache emptied. What a request allocates and how fast depends
on what ran before it in the process (a hit after auto's calibration took
up to 25 ms more than the same hit after another request), so the rows
differ in the policy alone.

The target is auto <= 1.1 x min(cold, forced) in every row.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from kvstore import PrefixStore
from kvstore.adapters.generate import generate, model_key
from kvstore.cost.model import PrefillModel
from kvstore.tools.bench.common import drop_page_cache

SOURCES = ("ram", "ssd_cached", "ssd_cold")
POLICIES = {"never": "cold_ms", "always": "forced_ms", "auto": "auto_ms"}
KV = {"fp16": None, "q8": 8, "q4": 4}
# Requests run in this cycle: each policy follows each policy (itself included) once per cycle. What ran
# just before changes a hit's TTFT on a GPU (the buffers left to reuse), and rotating one order put
# "always" after "never" in two of three repeats and "auto" after "always" (docs/benchmarks.md, hot path)
_CYCLE = ("never", "never", "always", "never", "auto", "always", "always", "auto", "auto")


def timed_fetch(store: PrefixStore) -> list[float]:
    """Seconds of each ``store.fetch`` from now on (the store's part of a
    request's TTFT; the rest is the engine's)."""
    times: list[float] = []
    fetch = store.fetch

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fetch(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)
    store.fetch = timed
    return times


def request_order(repeats: int) -> list[str]:
    """``repeats`` requests per policy, in the order of ``_CYCLE`` (a de
    Bruijn sequence of the three policies, taken cyclically): whole cycles
    only, since a part of one runs the policies unequally often."""
    if repeats <= 0 or repeats % 3:
        raise ValueError(f"repeats must be a positive multiple of 3 (whole cycles of the order), got {repeats}")
    return [_CYCLE[i % len(_CYCLE)] for i in range(3 * repeats)]


def _prompt(tokenizer, n: int, seed: int) -> list[int]:
    vocab = max(100, min(getattr(tokenizer, "vocab_size", 32000), 32000))
    return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]


def _ttft(model, tokenizer, store, prompt) -> tuple[float, object]:
    r = generate(model, tokenizer, prompt, store=store, max_tokens=1)
    store.flush()  # the answer's new block is written before the next request is timed
    return r.ttft_s, r


def _prefilled(model, prompt: list[int], step: int = 2048) -> list:
    """The prompt's cache, computed outside ``generate``: no store observes it."""
    from mlx_lm.models import cache as C
    cache = C.make_prompt_cache(model)
    for i in range(0, len(prompt), step):
        model(mx.array(prompt[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _fresh_row(model, tokenizer, key, prompt, cache, path: Path, kind: str, block: int, source: str,
               repeats: int) -> dict:
    """One row, each request the first of a store and engine that know nothing."""
    from kvstore.adapters.generate import calibrate_once, store_cache
    if source not in ("ram", "device") and not path.exists():
        with PrefixStore(budget_gb=0, ssd_path=path, kv_bits=KV[kind], block_size=block, fetch_policy="never",
                         remember_rates=False) as s:
            store_cache(s, key, prompt, cache)
    kw = dict(kv_bits=KV[kind], block_size=block, remember_rates=False)
    out = {p: {"ttft": [], "cached": [], "open": [], "calibrate": [], "fetch": []} for p in POLICIES}
    for policy in request_order(repeats):
        if source == "ssd_cold":
            for f in path.glob("*.mdb"):
                drop_page_cache(f)
        t = time.perf_counter()
        if source == "ram":
            s = PrefixStore(budget_gb=8, device_budget_gb=0, fetch_policy=policy, **kw)
        elif source == "device":
            s = PrefixStore(budget_gb=8, device_budget_gb=8, fetch_policy=policy, **kw)
        else:
            s = PrefixStore(budget_gb=0, ssd_path=path, fetch_policy=policy, **kw)
        out[policy]["open"].append(time.perf_counter() - t)
        try:
            if source in ("ram", "device"):
                store_cache(s, key, prompt, cache)
                s.flush()
            if source == "device":  # a first hit leaves device copies (the request timed is the next one)
                s.fetch(key, prompt[:-1], limit=len(prompt) - 1)
            # set-up, as the server does at load (generate would do it in the request, outside its TTFT);
            # done here so that what auto weighs is read before the request: priors, the calibrated model.
            # The same prefills precede every policy's request (under never/always on a store of their own):
            # requests then differ in their policy only, not in what the GPU ran just before
            calibrated = calibrate_once(s, key, [model])
            if policy != "auto":
                with PrefixStore(budget_gb=0.01, fetch_policy="auto", remember_rates=False) as side:
                    calibrate_once(side, key, [model])
            if policy == "auto" and "weighed" not in out:
                cost = s.stats()["cost"]
                fit = next(iter(cost["prefill"].values()), {})
                pm = PrefillModel(fit.get("a_s", 0.0), fit.get("s_per_token", 0.0),
                                  fit.get("s_per_token_context", 0.0))
                out["weighed"] = {"rates_gbps": {k: round(v["gb_per_s"], 2) for k, v in cost["rates"].items()},
                                  "prefill_predicted_ms": round(1e3 * pm.seconds(0, len(prompt)), 1),
                                  "prefill_fit": fit}
            fetched = timed_fetch(s)
            mx.clear_cache()  # as an engine that has served nothing has it, whichever request ran before
            t, r = _ttft(model, tokenizer, s, prompt)
            out[policy]["fetch"].append(sum(fetched))
            out[policy]["ttft"].append(t)
            out[policy]["cached"].append(r.cached_tokens)
            out[policy]["calibrate"].append(calibrated + r.calibrate_s)
        finally:
            s.close()
    row = {}
    for policy, name in POLICIES.items():
        o = out[policy]
        row[name] = statistics.median(o["ttft"]) * 1e3
        row[f"{policy}_each_ms"] = [round(t * 1e3, 1) for t in o["ttft"]]
        row[f"{policy}_fetch_each_ms"] = [round(t * 1e3, 1) for t in o["fetch"]]
        row[f"{policy}_cached_tokens"] = statistics.median(o["cached"])
        row[f"{policy}_open_ms"] = round(statistics.median(o["open"]) * 1e3, 1)
    row["auto_calibrate_ms"] = round(statistics.median(out["auto"]["calibrate"]) * 1e3, 1)
    row["auto_weighed"] = out.get("weighed", {})
    return row


def run(model_path: str | None, lengths: list[int], kinds: list[str], repeats: int, block: int,
        out: Path | None = None, fresh: bool = False, sources: list[str] | None = None) -> dict:
    if model_path is None:
        from kvstore.adapters.tiny_models import ensure_tiny_model
        model_path = str(ensure_tiny_model("llama", max_position_embeddings=max(lengths) * 2))
    model, tokenizer = load(model_path)
    key = model_key(model)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="cost-bench-"))
    try:
        for n in lengths:
            for kind in kinds:
                path = tmp / f"store-{n}-{kind}"
                prompt = _prompt(tokenizer, n, n + len(kind))
                if fresh:
                    cache = _prefilled(model, prompt)
                    from kvstore.gpu import cuda
                    for source in sources or SOURCES + (("device",) if cuda.runtime() is not None else ()):
                        row = {"tokens": n, "kv": kind, "source": source}
                        row.update(_fresh_row(model, tokenizer, key, prompt, cache, path, kind, block, source,
                                              repeats))
                        _finish(row, rows, out, model_path, key, block, repeats, fresh)
                    shutil.rmtree(path, ignore_errors=True)
                    continue
                # the prefix goes into the store once (RAM and SSD)
                with PrefixStore(budget_gb=8, ssd_path=path, kv_bits=KV[kind], block_size=block) as s:
                    generate(model, tokenizer, prompt, store=s, max_tokens=1)
                for source in sources or SOURCES:
                    budget = 8 if source == "ram" else 0  # no RAM tier: every hit reads the SSD

                    def reopen(s=None):
                        if s is not None:
                            s.close()
                        for f in path.glob("*.mdb"):  # evicted from the page cache (no root needed)
                            drop_page_cache(f)
                        return PrefixStore(budget_gb=budget, ssd_path=path, kv_bits=KV[kind], block_size=block)

                    s = reopen()
                    try:
                        if source == "ram":
                            s.fetch_policy = "always"
                            generate(model, tokenizer, prompt, store=s, max_tokens=1)  # read once into RAM
                        row = {"tokens": n, "kv": kind, "source": source}
                        times = {p: [] for p in POLICIES}
                        cached = {p: [] for p in POLICIES}
                        for policy in request_order(repeats):  # interleaved: noise and carry-over fall alike
                            if source == "ssd_cold":
                                s = reopen(s)
                            s.fetch_policy = policy
                            t, r = _ttft(model, tokenizer, s, prompt)
                            times[policy].append(t)
                            cached[policy].append(r.cached_tokens)
                        for policy, name in POLICIES.items():
                            row[name] = statistics.median(times[policy]) * 1e3
                            row[f"{policy}_each_ms"] = [round(t * 1e3, 1) for t in times[policy]]
                            row[f"{policy}_cached_tokens"] = statistics.median(cached[policy])
                        row["store_cost"] = s.stats()["cost"]
                        _finish(row, rows, out, model_path, key, block, repeats, fresh)
                    finally:
                        s.close()
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _result(model_path, key, block, repeats, rows, fresh)


def _finish(row: dict, rows: list[dict], out: Path | None, *args) -> None:
    row["auto_vs_best"] = row["auto_ms"] / min(row["cold_ms"], row["forced_ms"])
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "store_cost"}), flush=True)
    if out is not None:  # row by row: a run cut short keeps the rows it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / "cost.json").write_text(json.dumps(_result(*args[:4], rows, *args[4:]), indent=1))


def _result(model_path: str, key: str, block: int, repeats: int, rows: list[dict], fresh: bool) -> dict:
    return {"model": model_path, "model_key": key, "block_size": block, "repeats": repeats, "fresh": fresh,
            "order": request_order(repeats), "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M"),
            "all_within_1_1": all(r["auto_vs_best"] <= 1.1 for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model folder (default: the tiny fixed-seed llama)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--kv", nargs="+", default=list(KV), choices=list(KV))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="write cost.json here")
    ap.add_argument("--fresh", action="store_true",
                    help="each request the first of a store that has measured nothing (see the docstring)")
    ap.add_argument("--sources", nargs="+", default=None, choices=SOURCES + ("device",),
                    help="these rows only (default: every source; device only with --fresh, on CUDA)")
    args = ap.parse_args(argv)
    if args.repeats <= 0 or args.repeats % 3:
        ap.error("--repeats must be a positive multiple of 3 (each policy follows each equally often)")
    if args.sources and "device" in args.sources and not args.fresh:
        ap.error("the device row is measured with --fresh only")
    res = run(args.model, args.lengths, args.kv, args.repeats, args.block_size, args.out, args.fresh, args.sources)
    worst = max(r["auto_vs_best"] for r in res["rows"])
    print(f"auto within 1.1x of min(cold, forced) in every row: {res['all_within_1_1']} (worst {worst:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
