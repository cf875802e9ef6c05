"""The live workload of issue 42: a replay of interleaved chat and agent
sessions on two shared system prompts, through the public API as an engine
calls it (``fetch_cache`` / ``store_cache``), each cache in a fresh process:

    python -m kvstore.tools.replay_gpu --model /tmp/llama-8b --out OUT        # GPU: 8B shape, ~270K tokens
    python -m kvstore.tools.replay_gpu --model tiny --trace cpu --out OUT     # CPU: the tiny llama

Systems: ``none`` (every token computed), ``lru`` (mlx-lm's ``LRUPromptCache``,
``max_bytes`` = B), ``kvstore_fp16`` / ``kvstore_q8`` (``budget_gb`` = B and
``device_budget_gb`` = B; ``--warm``: the same replay again on a second cache
of the same process, for every system: mlx builds its attention graph and kernels
once per shape, so the second round shows what the engine's own warm-up was), B = each of ``--budgets`` times the unique KV (fp16).
Per request: TTFT = fetch + prefill of the rest + first token; then the
response runs through the model and the cache of prompt + response is offered
back, ``put_s`` the time that takes the engine's thread. The floor of a run
is the prefill of the tokens it computed at the ``none`` run's rate plus the
bytes it loaded at the bus rate measured in that process (a pinned host ->
device copy on CUDA, a memcpy elsewhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TRACES = {  # settings of make_trace (tools/bench/replay.py)
    "gpu": dict(sys_lens=[4096, 2048], sys_p=[0.5, 0.5], sessions=10, concurrency=4, agent_frac=0.5,
                chat_turns=(3, 5), user=(100, 600), resp=(100, 400), agent_turns=(4, 6), tool=(300, 1600),
                action=(50, 200)),
    "cpu": dict(sys_lens=[512, 256], sys_p=[0.5, 0.5], sessions=6, concurrency=3, agent_frac=0.5,
                chat_turns=(2, 3), user=(30, 80), resp=(20, 60), agent_turns=(2, 4), tool=(60, 200),
                action=(10, 40)),
}


def _load(model: str):
    import mlx_lm

    if model == "tiny":
        from kvstore.adapters.tiny_models import ensure_tiny_model

        model = str(ensure_tiny_model("llama"))
    m, tok = mlx_lm.load(model)
    return m, model


SHAPE_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, head_dim=128, max_position_embeddings=65536)


def make_model(path: Path) -> Path:
    """The 8B-shaped llama of the GPU figures at ``path``: the tiny llama's
    tokenizer, mlx-lm's own random initialization, bf16 (a minute on a GPU,
    where drawing the tiny models' fixed-seed weights on the host takes
    several: the replay times prefills and caches, not what the model says)."""
    import shutil
    import tempfile

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from kvstore.adapters.tiny_models import make_tiny_model, model_config

    if (path / "model.safetensors").exists() and json.loads((path / "config.json").read_text()).get("shape") == "8B":
        return path
    config = dict(model_config("llama", **SHAPE_8B), dtype="bfloat16", torch_dtype="bfloat16", shape="8B")
    tmp = Path(tempfile.mkdtemp(prefix=".8b-", dir=path.parent))
    small = make_tiny_model("llama", tmp / "small", max_position_embeddings=SHAPE_8B["max_position_embeddings"])
    for f in small.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(small)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def _bus_gbps() -> float:
    """Host -> device bytes per second: pinned memory on the copy engine on CUDA, a memcpy elsewhere."""
    from kvstore import cuda

    n = 1 << 30
    rt = cuda.runtime()
    if rt is None:
        src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return n / (time.perf_counter() - t0) / 1e9
    src = rt.pinned(n)
    src[:] = 1
    best = 0.0
    with cuda.landing(n) as (_, addr), cuda.one_stream(rt) as stream:
        for _ in range(3):
            t0 = time.perf_counter()
            rt.copy(addr, src.ctypes.data, n, stream)
            rt.sync(stream)
            best = max(best, n / (time.perf_counter() - t0) / 1e9)
    return best


def replay(system: str, frac: float, model_arg: str, trace_name: str, warm: bool, profile: bool = False,
           idle_writer: bool = False) -> dict:
    import mlx.core as mx
    from mlx_lm.models import cache as C

    from kvstore import PrefixStore
    from kvstore.adapters.generate import calibrate_once, fetch_cache, model_key, store_cache

    from .bench.common import describe_model, run_tokens
    from .bench.replay import make_trace

    t0 = time.perf_counter()
    model, path = _load(model_arg)
    load_s = time.perf_counter() - t0
    trace = make_trace(TRACES[trace_name])
    _, bpt = describe_model("llama", model)
    budget = int(frac * trace["unique_tokens"] * bpt)
    mkey = model_key(model, path)
    run_tokens(model, C.make_prompt_cache(model), list(range(5, 300)))  # kernels of a prefill, for every system
    out = {"system": system, "budget_frac": frac, "budget_bytes": budget, "load_s": load_s,
           "requests": len(trace["requests"]), "prompt_tokens": trace["prompt_tokens"],
           "unique_tokens": trace["unique_tokens"], "kv_bytes_per_token": bpt,
           "longest": max(len(r["prompt"]) for r in trace["requests"]), "bus_gbps": _bus_gbps(), "runs": []}
    import gc

    pauses = [0.0, 0.0]  # (start of the collection running, seconds in full collections)

    def timed_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                pauses[0] = time.perf_counter()
            else:
                pauses[1] += time.perf_counter() - pauses[0]

    gc.callbacks.append(timed_gc)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile() if profile and system.startswith("kvstore") else None
    for round_ in range(2 if warm else 1):
        pauses[1] = 0.0
        lru = store = None
        t0 = time.perf_counter()
        if system == "lru":
            lru = C.LRUPromptCache(max_size=1 << 20, max_bytes=budget)
        elif system.startswith("kvstore"):
            store = PrefixStore(budget_gb=budget / 2**30, device_budget_gb=budget / 2**30, block_size=256,
                                kv_bits=None if system == "kvstore_fp16" else 8)
        open_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if store is not None:
            calibrate_once(store, mkey, [model])
        rows = []
        run = {"round": round_, "open_s": open_s, "calibrate_s": time.perf_counter() - t0, "rows": rows}
        for req in trace["requests"]:
            prompt = req["prompt"].tolist()
            n = len(prompt)
            t0 = time.perf_counter()
            row = {"session": req["session"], "prompt_tokens": n}
            if lru is not None:
                cache, rest = lru.fetch_nearest_cache(mkey, prompt)
                if cache is None:
                    cache = C.make_prompt_cache(model)
                elif not rest:
                    C.trim_prompt_cache(cache, 1)
                    rest = prompt[-1:]
                got = n - len(rest)
            elif store is not None:
                if prof is not None and round_ == 0:
                    prof.enable()
                r = fetch_cache(store, model, mkey, prompt)
                if prof is not None:
                    prof.disable()
                cache, got = r.cache, r.cached_tokens
                row.update(ram_tokens=r.ram_tokens, ssd_tokens=r.ssd_tokens)
            else:
                cache, got = C.make_prompt_cache(model), 0
            row["fetch_s"] = time.perf_counter() - t0
            y = mx.argmax(run_tokens(model, cache, prompt[got:]))
            mx.eval(y)
            row["ttft_s"] = time.perf_counter() - t0
            row["cached_tokens"] = got
            resp = req["response"].tolist()
            run_tokens(model, cache, resp, logits=False)
            t1 = time.perf_counter()
            if lru is not None:
                lru.insert_cache(mkey, prompt + resp, cache)
            elif store is not None:
                store_cache(store, mkey, prompt + resp, cache)
            row["put_s"] = time.perf_counter() - t1
            if idle_writer and store is not None:  # (untimed) the next request runs with the writer idle
                store.flush()
            rows.append(row)
            del cache
        run["gc_full_s"] = pauses[1]
        if store is not None:
            store.flush()
            st = store.stats()
            run["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
            store.close()
        _summarize(run, out)
        out["runs"].append(run)
    if prof is not None:  # where the first round's fetches spent their time (the engine's thread only)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        out["fetch_profile"] = text.getvalue()
    return out


def _summarize(run: dict, out: dict) -> None:
    rows = run["rows"]
    ttft = [r["ttft_s"] for r in rows]
    put = [r["put_s"] for r in rows]
    run.update(ttft_total_s=sum(ttft), ttft_p50_s=float(np.percentile(ttft, 50)),
               ttft_p95_s=float(np.percentile(ttft, 95)), ttft_max_s=max(ttft),
               computed_tokens=out["prompt_tokens"] - sum(r["cached_tokens"] for r in rows),
               loaded_bytes=sum(r["cached_tokens"] for r in rows) * out["kv_bytes_per_token"],
               fetch_total_s=sum(r["fetch_s"] for r in rows),
               prefill_total_s=sum(r["ttft_s"] - r["fetch_s"] for r in rows), put_p50_ms=float(np.percentile(put, 50)) * 1e3,
               put_p99_ms=float(np.percentile(put, 99)) * 1e3, put_max_ms=max(put) * 1e3)


def _child(system: str, frac: float, a) -> dict:
    dst = a.out / f"replay-{system}-{frac:g}.json"
    cmd = [sys.executable, "-m", "kvstore.tools.replay_gpu", "--one", system, "--budget", str(frac), "--model",
           a.model, "--trace", a.trace, "--out", str(dst)] + (["--warm"] if a.warm else []) + \
        (["--profile"] if a.profile else []) + \
        ([] if a.switch_interval is None else ["--switch-interval", str(a.switch_interval)]) + \
        (["--idle-writer"] if a.idle_writer else [])
    subprocess.run(cmd, check=True)
    return json.loads(dst.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="an mlx-lm model folder, or 'tiny'")
    ap.add_argument("--trace", choices=sorted(TRACES), default="gpu")
    ap.add_argument("--systems", nargs="+", default=["none", "lru", "kvstore_fp16", "kvstore_q8"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.10])
    ap.add_argument("--warm", action="store_true", help="the replay again on a second cache of the same process")
    ap.add_argument("--profile", action="store_true", help="a cProfile of the first round's fetches in the JSON")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in each replay's process (seconds; Python's default 0.005): how much of "
                         "the engine's time goes to waiting for the interpreter while the store's threads work")
    ap.add_argument("--idle-writer", action="store_true",
                    help="flush after each put, untimed: each request runs with the store's writer idle (a diagnosis)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0.25, help=argparse.SUPPRESS)
    ap.add_argument("--make-model", action="store_true", help="write the 8B-shaped llama at --model and stop")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.make_model:
        make_model(Path(a.model))
        return 0
    if a.out is None:
        ap.error("--out is required")
    if a.one is not None:
        if a.switch_interval is not None:
            sys.setswitchinterval(a.switch_interval)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(replay(a.one, a.budget, a.model, a.trace, a.warm, a.profile, a.idle_writer), indent=1))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    results = {}
    if "none" in a.systems:
        results["none"] = _child("none", 1.0, a)
    for frac in a.budgets:
        for system in a.systems:
            if system != "none":
                results[f"{system}@{frac:g}"] = _child(system, frac, a)
    (a.out / "summary.json").write_text(json.dumps(_table(results), indent=1))
    return 0


def _table(results: dict) -> dict:
    """Each run's totals, its ratios to LRU of the same budget and round, to its floor, and each request to its
    cold TTFT (the ``none`` run of the same round: a second round's shapes are warm for every system alike)."""
    none = results.get("none")
    table = {"runs": {}}
    for name, res in results.items():
        for run in res["runs"]:
            r_ = run["round"]
            key = name + ("" if r_ == 0 else " (second round)")
            row = {k: run[k] for k in ("ttft_total_s", "ttft_p50_s", "ttft_p95_s", "ttft_max_s", "computed_tokens",
                                       "fetch_total_s", "prefill_total_s", "put_p50_ms", "put_p99_ms", "put_max_ms",
                                       "open_s", "calibrate_s")}
            row["bus_gbps"] = res["bus_gbps"]
            if none is not None:
                base = none["runs"][min(r_, len(none["runs"]) - 1)]
                rate = none["prompt_tokens"] / base["ttft_total_s"]
                table.setdefault("prefill_tokens_per_s", {})[str(r_)] = rate
                row["floor_s"] = run["computed_tokens"] / rate + run["loaded_bytes"] / (res["bus_gbps"] * 1e9)
                row["vs_floor"] = run["ttft_total_s"] / row["floor_s"]
                row["worst_vs_cold"] = max(r["ttft_s"] / c["ttft_s"] for r, c in zip(run["rows"], base["rows"]))
            lru = results.get(f"lru@{res['budget_frac']:g}")
            if lru is not None:
                row["vs_lru"] = run["ttft_total_s"] / lru["runs"][min(r_, len(lru["runs"]) - 1)]["ttft_total_s"]
            if r_ > 0:
                row["vs_first_round"] = run["ttft_total_s"] / res["runs"][0]["ttft_total_s"]
            row["gc_full_s"] = run["gc_full_s"]
            for k in ("puts_skipped", "blocks_skipped", "evictions_ram", "writer_us", "fetch_waited_us", "pinned_made_bytes",
                      "pinned_made_s", "pageable_past_cap_bytes"):
                if k in run.get("stats", {}):
                    row[k] = run["stats"][k]
            table["runs"][key] = row
            print(f"{key:28s} total {row['ttft_total_s']:7.2f} s  prefill {row['prefill_total_s']:6.2f} s  "
                  f"fetch {row['fetch_total_s']:5.2f} s  p50 {row['ttft_p50_s'] * 1e3:5.0f} ms  "
                  f"computed {row['computed_tokens']:8,}  put p99 {row['put_p99_ms']:6.2f} ms  " + "  ".join(
                      f"{k} {row[k]:.2f}" for k in ("vs_lru", "vs_floor", "worst_vs_cold", "vs_first_round")
                      if k in row) + (f"  waited {row['fetch_waited_us'] / 1e6:.2f} s" if "fetch_waited_us" in row else ""),
                  flush=True)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
