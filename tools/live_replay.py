"""Issue 42's live replay: interleaved chat and agent sessions on two shared
system prompts, through the public API as an engine uses it, each cache in a
fresh process under the same memory.

    python -m kvstore.tools.live_replay --model PATH|tiny --trace gpu|cpu|smoke \\
        --systems none lru kvstore_fp16 kvstore_q8 --budgets 0.25 0.10 --out DIR [--fresh-process] [--warm] [--ssd]
        [--ssd-admit always|reuse]
    python -m kvstore.tools.live_replay serve --model PATH|tiny --trace gpu --clients 8 --out DIR

The trace is ``tools/bench/replay.py``'s ``make_trace`` (``TRACES``: "gpu" is
sized as the issue's: 10 sessions, 4 at a time, system prompts of 4,096 and
2,048 tokens). Per request: TTFT = fetch + prefill of the rest + the first
token (``mx.eval`` of the argmax, the model on mlx-lm's generation stream);
then the response runs through the model (teacher-forced) and the cache of
prompt + response is offered to the cache, timed alone as ``put_s`` (what the
engine's thread spends in ``store_cache`` / ``insert_cache``).

Caches, with B = budget x the trace's unique KV (fp16 bytes): ``none``;
``lru``: mlx-lm's ``LRUPromptCache(max_bytes=B)`` (entries in GPU memory);
``kvstore_fp16`` / ``kvstore_q8``: ``PrefixStore(budget_gb=B, device_budget_gb=B,
block_size=256)``, ``fetch_cache`` / ``store_cache``, ``calibrate_once``
before the first request (``calibrate_s``, not in TTFT). ``--warm`` replays
twice in one process on two successive new stores (``warm_run``: the second).

The parent runs each (cache, budget) as ``--one CACHE:BUDGET`` in a child
process (``--fresh-process``; without it one child runs them all in turn) and
never loads the model itself; it writes ``replay-CACHE-BUDGET.json`` per run,
``summary.json`` (ratios, the floor, the issue's checks) and prints a table.

The floor of a run: its computed tokens at the ``none`` run's prefill rate
(prompt tokens over TTFT) + the bytes its hits served (``Hit.source_bytes``)
at ``bus_gbps``, the faster of an ``mx.array(numpy)`` copy of 512 MiB (64 MiB
on a CPU) and the store's own measured RAM fetch rate.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

GiB = 1 << 30
SYSTEMS = ("none", "lru", "kvstore_fp16", "kvstore_q8")
# make_trace's keys. "gpu", seed 50: 43 requests, 269,984 prompt tokens, longest 14,449, 59,110 unique tokens
# (7.2 GiB of fp16 KV on the 8B shape); "cpu": 28 requests, 20,692 tokens; "smoke": 12 requests, 5.9K tokens.
TRACES = {
    "gpu": dict(sys_lens=[4096, 2048], sys_p=[0.5, 0.5], sessions=10, concurrency=4, chat_turns=(2, 5),
                user=(64, 384), resp=(128, 512), agent_turns=(4, 7), tool=(768, 1792), action=(128, 384),
                agent_frac=0.5),
    "cpu": dict(sys_lens=[512, 256], sys_p=[0.5, 0.5], sessions=8, concurrency=4, chat_turns=(2, 4), user=(16, 64),
                resp=(32, 96), agent_turns=(3, 5), tool=(64, 224), action=(16, 48), agent_frac=0.5),
    "smoke": dict(sys_lens=[512, 256], sys_p=[0.5, 0.5], sessions=4, concurrency=2, chat_turns=(2, 3), user=(8, 32),
                  resp=(8, 24), agent_turns=(2, 3), tool=(32, 96), action=(8, 16), agent_frac=0.5),
}
SEED = 50
# the "must hold" (H200, 8B shape): kvstore fp16 / LRU per budget, and the rest
TARGETS = {"fp16_vs_lru": {0.25: 0.6, 0.1: 0.5}, "fp16_vs_floor": 1.25, "q8_vs_fp16": 1.1, "fresh_vs_warm": 1.1,
           "vs_cold": 1.1, "put_p99_s": 2e-3, "put_max_s": 10e-3, "serve_vs_mlx_lm": 0.5}


def log(msg: str) -> None:
    print(f"[live-replay {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else 0.0


def run_name(system: str, frac: float) -> str:
    return "none" if system == "none" else f"{system}-{frac:g}"


# ------------------------------------------------------------------ one run, in the child


def load(model: str):
    """(model, path): the tiny llama for "tiny", else an mlx-lm folder."""
    if model == "tiny":
        from kvstore.tools.bench.common import load_tiny

        m, _, path = load_tiny("llama")
        return m, path
    import mlx_lm

    return mlx_lm.load(model)[0], Path(model)


def kv_bytes_per_token(model) -> int:
    from kvstore.tools.bench.common import kv_shape

    layers, heads, dim, dtype = kv_shape(model)
    return 2 * layers * heads * dim * dtype.size


def bus_gbps(nbytes: int) -> float:
    """GB/s of ``mx.array(numpy buffer)`` evaluated and read once on the device (best of 3): a lower
    bound on the host -> device bus (mlx exposes no pinned copy)."""
    import mlx.core as mx

    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x = mx.array(buf)
        mx.eval(mx.max(x))
        best = min(best, time.perf_counter() - t)
        del x
    return nbytes / best / 1e9


def replay(system: str, trace: dict, model, mkey: str, budget: int, ssd: Optional[Path],
           ssd_admit: str = "always") -> dict:
    """The trace through one new cache: per-request rows and the run's figures."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models import cache as C

    from kvstore import PrefixStore
    from kvstore.adapters.generate import calibrate_once, fetch_cache, store_cache
    from kvstore.tools.bench.common import run_tokens
    from kvstore.tools.bench.replay import lru_fetch

    lru = store = None
    t = time.perf_counter()
    if system == "lru":
        lru = C.LRUPromptCache(max_size=1 << 20, max_bytes=budget)
    elif system != "none":
        store = PrefixStore(budget_gb=budget / GiB, device_budget_gb=budget / GiB, block_size=256, ssd_path=ssd,
                            kv_bits=None if system == "kvstore_fp16" else 8, ssd_admit=ssd_admit)
    open_s = time.perf_counter() - t
    calibrate_s = calibrate_once(store, mkey, [model]) if store is not None else 0.0
    rows = []
    t_start = time.perf_counter()
    for i, req in enumerate(trace["requests"]):
        ids = req["prompt"]  # int32: the store's form; mlx-lm's server keeps lists (made outside the timing)
        prompt = ids.tolist()
        row: dict[str, Any] = {"i": i, "session": req["session"], "prompt_tokens": len(prompt)}
        t0 = time.perf_counter()
        hit = None
        if lru is not None:
            cache, got = lru_fetch(lru, model, mkey, prompt)
        elif store is not None:
            r = fetch_cache(store, model, mkey, ids)
            cache, got, hit = r.cache, r.cached_tokens, r.hit
            row.update(ram_tokens=r.ram_tokens, ssd_tokens=r.ssd_tokens,
                       source_bytes=dict(hit.source_bytes) if hit else {},
                       skipped_tokens=hit.skipped_tokens if hit else 0)
        else:
            cache, got = C.make_prompt_cache(model), 0
        t1 = time.perf_counter()
        with mx.stream(generation_stream):
            logits = run_tokens(model, cache, prompt[got:])
            mx.eval(mx.argmax(logits))
        ttft = time.perf_counter() - t0
        if store is not None:  # as the adapters do: what auto learns prefill and a hit's real cost from
            store.observe_request(mkey, len(prompt), hit, ttft)
        resp = req["response"]
        with mx.stream(generation_stream):
            run_tokens(model, cache, resp, logits=False)
        full = np.concatenate([ids, resp])
        t2 = time.perf_counter()
        if lru is not None:
            lru.insert_cache(mkey, full.tolist(), cache)
        elif store is not None:
            store_cache(store, mkey, full, cache)
        put_s = time.perf_counter() - t2
        del cache
        row.update(cached_tokens=got, computed_tokens=len(prompt) - got, fetch_s=t1 - t0, prefill_s=ttft - (t1 - t0),
                   ttft_s=ttft, put_s=put_s if system != "none" else 0.0)
        rows.append(row)
    out: dict[str, Any] = {"system": system, "budget_bytes": budget, "open_s": open_s, "calibrate_s": calibrate_s}
    if store is not None:
        t = time.perf_counter()
        store.flush()
        out["flush_s"] = time.perf_counter() - t
        out["store_stats"] = store.stats()
        store.close()
    elif lru is not None:
        out.update(lru_bytes_end=lru.nbytes, lru_entries_end=len(lru))
    out["wall_s"] = time.perf_counter() - t_start
    ttfts, puts = [r["ttft_s"] for r in rows], [r["put_s"] for r in rows]
    out.update(requests=len(rows), prompt_tokens=sum(r["prompt_tokens"] for r in rows),
               tokens_computed=sum(r["computed_tokens"] for r in rows),
               cached_tokens=sum(r["cached_tokens"] for r in rows),
               bytes_served=sum(sum(r.get("source_bytes", {}).values()) for r in rows),
               ttft_total_s=float(sum(ttfts)), ttft_p50_s=pct(ttfts, 50), ttft_p95_s=pct(ttfts, 95),
               ttft_max_s=max(ttfts), put_p50_s=pct(puts, 50), put_p99_s=pct(puts, 99), put_max_s=max(puts),
               rows=rows)
    return out


def child(a: argparse.Namespace) -> int:
    import gc

    import mlx.core as mx
    from mlx_lm.models import cache as C

    from kvstore.adapters.generate import model_key
    from kvstore.tools.bench.common import machine, run_tokens
    from kvstore.tools.bench.replay import make_trace

    t = time.perf_counter()
    model, path = load(a.model)
    load_s = time.perf_counter() - t
    mkey = model_key(model, path)
    trace = make_trace(TRACES[a.trace], SEED)
    bpt = kv_bytes_per_token(model)
    unique = trace["unique_tokens"] * bpt
    run_tokens(model, C.make_prompt_cache(model), list(range(5, 517)))  # first model run of the process
    gpu = mx.default_device().type == mx.gpu
    for item in a.one:
        system, _, frac = item.partition(":")
        frac = 0.0 if system == "none" else float(frac or a.budget_frac)
        budget = int(frac * unique)
        ssd = a.dir / f"ssd-{run_name(system, frac)}" if a.ssd and system.startswith("kvstore") else None
        log(f"{system} at {frac:g} of {unique / GiB:.3f} GiB unique KV: budget {budget / GiB:.3f} GiB")
        res = replay(system, trace, model, mkey, budget, ssd, a.ssd_admit)
        if a.warm and system.startswith("kvstore"):  # a second new store in this (now warm) process
            gc.collect()
            res["warm_run"] = replay(system, trace, model, mkey, budget, None if ssd is None else Path(f"{ssd}-2"),
                                     a.ssd_admit)
        if system.startswith("kvstore"):
            res["copy_gbps"] = bus_gbps((512 if gpu else 64) << 20)
        res.update(budget_frac=frac, load_s=load_s, model=str(path), kv_bytes_per_token=bpt, unique_kv_bytes=unique,
                   device=str(mx.default_device()), machine=machine(), mlx=mx.__version__,
                   trace={"name": a.trace, "seed": SEED, **TRACES[a.trace], "requests": len(trace["requests"]),
                          "sessions": len(trace["sessions"]), "chat_sessions": trace["n_chat"],
                          "agent_sessions": trace["n_agent"], "prompt_tokens": trace["prompt_tokens"],
                          "longest": max(len(r["prompt"]) for r in trace["requests"]),
                          "unique_tokens": trace["unique_tokens"], "ideal_cached_tokens": trace["ideal_cached_tokens"]})
        out = a.out / f"replay-{run_name(system, frac)}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str))
        log(f"{system}: TTFT total {res['ttft_total_s']:.2f} s, computed {res['tokens_computed']:,}, "
            f"put p99 {res['put_p99_s'] * 1e3:.1f} ms -> {out}")
        gc.collect()
    return 0


# ------------------------------------------------------------------ the parent: processes and the summary


def summarize(runs: dict[str, dict]) -> dict:
    """Ratios, the floor and the issue's checks from the runs' JSON (keyed by ``run_name``)."""
    none = runs.get("none")
    rate = none["prompt_tokens"] / none["ttft_total_s"] if none else None
    out: dict[str, Any] = {"prefill_tok_per_s_none": rate, "runs": {}, "checks": {}}
    for name, r in runs.items():
        s = {k: r.get(k) for k in ("system", "budget_frac", "ttft_total_s", "ttft_p50_s", "ttft_p95_s", "ttft_max_s",
                                   "tokens_computed", "bytes_served", "put_p50_s", "put_p99_s", "put_max_s", "wall_s",
                                   "load_s", "open_s", "calibrate_s", "flush_s", "copy_gbps")}
        if none:
            ratios = [x["ttft_s"] / c["ttft_s"] for x, c in zip(r["rows"], none["rows"])]
            s["vs_cold_max"], s["vs_cold_over_1_1"] = max(ratios), sum(x > TARGETS["vs_cold"] for x in ratios)
        if r.get("store_stats"):
            ram = r["store_stats"]["cost"]["rates"].get("ram", {})
            s["store_ram_gbps"] = ram.get("gb_per_s") if ram.get("observed") else None
            s["bus_gbps"] = max(x for x in (s["copy_gbps"], s["store_ram_gbps"]) if x)
            if rate:
                s["floor_s"] = r["tokens_computed"] / rate + r["bytes_served"] / (s["bus_gbps"] * 1e9)
                s["vs_floor"] = r["ttft_total_s"] / s["floor_s"]
        if r.get("warm_run"):
            s["warm_ttft_total_s"] = r["warm_run"]["ttft_total_s"]
            s["fresh_vs_warm"] = r["ttft_total_s"] / s["warm_ttft_total_s"]
        out["runs"][name] = s
    for name, s in out["runs"].items():
        lru = out["runs"].get(run_name("lru", s["budget_frac"]))
        if lru and s["system"] != "lru" and s["system"] != "none":
            s["vs_lru"] = s["ttft_total_s"] / lru["ttft_total_s"]
        fp16 = out["runs"].get(run_name("kvstore_fp16", s["budget_frac"]))
        if fp16 and s["system"] == "kvstore_q8":
            s["vs_fp16"] = s["ttft_total_s"] / fp16["ttft_total_s"]
    checks = out["checks"]
    for name, s in out["runs"].items():
        if not s["system"].startswith("kvstore"):
            continue
        if s["system"] == "kvstore_fp16":
            want = TARGETS["fp16_vs_lru"].get(round(s["budget_frac"], 2))
            if want and "vs_lru" in s:
                checks[f"{name} vs lru <= {want}"] = s["vs_lru"] <= want
            if "vs_floor" in s:
                checks[f"{name} vs floor <= {TARGETS['fp16_vs_floor']}"] = s["vs_floor"] <= TARGETS["fp16_vs_floor"]
        if "vs_fp16" in s:
            checks[f"{name} vs fp16 <= {TARGETS['q8_vs_fp16']}"] = s["vs_fp16"] <= TARGETS["q8_vs_fp16"]
        if "fresh_vs_warm" in s:
            checks[f"{name} fresh vs warm <= {TARGETS['fresh_vs_warm']}"] = s["fresh_vs_warm"] <= TARGETS["fresh_vs_warm"]
        if "vs_cold_max" in s:
            checks[f"{name} no request over {TARGETS['vs_cold']}x cold"] = s["vs_cold_over_1_1"] == 0
        checks[f"{name} put p99 <= 2 ms, max <= 10 ms"] = (s["put_p99_s"] <= TARGETS["put_p99_s"]
                                                          and s["put_max_s"] <= TARGETS["put_max_s"])
    return out


def table(summary: dict) -> str:
    def f(x, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
        return "" if x is None else fmt.format(x * scale)

    lines = ["| cache | B | total TTFT s | p50 / p95 / max ms | tokens computed | put p50 / p99 / max ms | vs LRU "
             "| floor s (x) | fresh / warm | max vs cold |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["runs"].values():
        ttft = " / ".join(f(s[k], "{:.0f}", 1e3) for k in ("ttft_p50_s", "ttft_p95_s", "ttft_max_s"))
        put = " / ".join(f(s[k], "{:.2f}", 1e3) for k in ("put_p50_s", "put_p99_s", "put_max_s"))
        floor = f(s.get("floor_s")) + ("" if "vs_floor" not in s else f" ({s['vs_floor']:.2f}x)")
        lines.append(f"| {s['system']} | {f(s['budget_frac'] or None, '{:.0%}')} | {s['ttft_total_s']:.2f} | {ttft} "
                     f"| {s['tokens_computed']:,} | {put} | {f(s.get('vs_lru'))} | {floor} "
                     f"| {f(s.get('fresh_vs_warm'))} | {f(s.get('vs_cold_max'))} |")
    return "\n".join(lines)


def parent(a: argparse.Namespace) -> int:
    jobs = (["none"] if "none" in a.systems else []) + [f"{s}:{f:g}" for f in a.budgets for s in a.systems if s != "none"]
    common = ["--model", a.model, "--trace", a.trace, "--out", str(a.out), "--dir", str(a.dir)] + \
        ["--warm"] * a.warm + ["--ssd"] * a.ssd + ["--ssd-admit", a.ssd_admit]
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


# ------------------------------------------------------------------ through the servers


def word_text(tokenizer, ids) -> str:
    """Token ids as words that are one token each (" the"), so the server's tokens track the trace's."""
    vocab = tokenizer.get_vocab()
    words = sorted(k[1:] for k in vocab if k.startswith("Ġ") and k[1:].isascii() and k[1:].isalpha())
    return "".join(" " + words[int(i) % len(words)] for i in ids)


def serve_prompts(tokenizer, trace: dict) -> list[dict]:
    """The trace's requests as text: each session's history (system, then each turn's new part and the
    trace's response) shares its prefix textually with its later turns."""
    systems = [word_text(tokenizer, s) for s in trace["systems"]]
    ctx = {i: systems[s["system"]] for i, s in enumerate(trace["sessions"])}
    turn = {i: 0 for i in ctx}
    out = []
    for r in trace["requests"]:
        s = r["session"]
        new, resp = trace["sessions"][s]["segs"][turn[s]]
        prompt = ctx[s] + word_text(tokenizer, new)
        ctx[s] = prompt + word_text(tokenizer, resp)
        turn[s] += 1
        out.append({"session": s, "prompt": prompt, "response_tokens": len(resp)})
    return out


def client_replay(port: int, model: str, reqs: list[dict], clients: int, max_tokens: int) -> list[dict]:
    """``clients`` threads; each takes the first request whose session has no request in flight (a
    session's turns stay in order), streams it from the OpenAI-compatible completions endpoint (plain
    HTTP: the GPU machine has no ``openai`` package) and times the first chunk with a token."""
    left, busy, rows = list(range(len(reqs))), set(), [None] * len(reqs)
    cond = threading.Condition()
    origin = time.perf_counter()

    def take() -> Optional[int]:
        with cond:
            while True:
                if not left:
                    return None
                ready = [i for i in left if reqs[i]["session"] not in busy]
                firsts = [i for i in ready if all(j >= i or reqs[j]["session"] != reqs[i]["session"] for j in left)]
                if firsts:
                    left.remove(firsts[0])
                    busy.add(reqs[firsts[0]]["session"])
                    return firsts[0]
                cond.wait()

    def work() -> None:
        while (i := take()) is not None:
            r = reqs[i]
            row: dict[str, Any] = {"i": i, "session": r["session"], "ttft_s": None, "error": None}
            t0 = time.perf_counter()
            body = {"model": model, "prompt": r["prompt"], "temperature": 0.0, "stream": True,
                    "max_tokens": min(max_tokens, max(1, r["response_tokens"])), "stream_options": {"include_usage": True}}
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
                for line in resp:  # server-sent events; ": keepalive" comments come during a long prefill
                    if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and row["ttft_s"] is None:
                        row["ttft_s"] = time.perf_counter() - t0
                    if chunk.get("usage"):
                        row["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                        row["cached_tokens"] = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                conn.close()
                if row["ttft_s"] is None:
                    row["error"] = "no token streamed"
            except Exception as e:  # noqa: BLE001 - an error is a result here, counted
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            row.update(start_s=t0 - origin, end_s=time.perf_counter() - origin, total_s=time.perf_counter() - t0)
            rows[i] = row
            with cond:
                busy.discard(r["session"])
                cond.notify_all()

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def serve(a: argparse.Namespace) -> int:
    from mlx_lm.utils import load_tokenizer

    from kvstore.tools.bench.replay import make_trace
    from kvstore.tools.servers import free_port, stop, wait_answering

    if a.model == "tiny":
        from kvstore.adapters.tiny_models import ensure_tiny_model

        a.model = str(ensure_tiny_model("llama"))
    path = Path(a.model)
    cfg = json.loads((path / "config.json").read_text())
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dsize = 4 if cfg.get("dtype", cfg.get("torch_dtype")) == "float32" else 2
    bpt = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * dim * dsize
    trace = make_trace(TRACES[a.trace], SEED)
    reqs = serve_prompts(load_tokenizer(path), trace)
    budget = int(a.budget_frac * trace["unique_tokens"] * bpt)
    servers = {
        "mlx_lm_server": [sys.executable, "-m", "mlx_lm.server", "--prompt-cache-size", str(1 << 20)],
        # what `kvstore serve` runs (adapters/cli.py), without the CLI's typer, which the GPU machine may lack
        "kvstore_serve": [sys.executable, "-c", "import sys; from kvstore.adapters.server import serve; "
                          "serve(sys.argv[1:])"],
    }
    res: dict[str, Any] = {"model": str(path), "trace": {"name": a.trace, "seed": SEED, "requests": len(reqs)},
                           "clients": a.clients, "max_tokens": a.max_tokens, "budget_frac": a.budget_frac,
                           "budget_bytes": budget, "servers": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    for name, cmd in servers.items():
        port = free_port()
        logf = a.out / f"serve-{name}.log"
        cmd = [*cmd, "--model", str(path), "--host", "127.0.0.1", "--port", str(port), "--prompt-cache-bytes",
               str(budget), "--temp", "0"]
        log("starting: " + " ".join(cmd))
        with open(logf, "w") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
            try:
                t = time.perf_counter()
                wait_answering(f"http://127.0.0.1:{port}/health", proc, 600, name)
                # warm-up: the model's first run, on words no request starts with
                client_replay(port, str(path), [{"session": -1, "prompt": " zzz" * 64, "response_tokens": 1}], 1, 1)
                start_s = time.perf_counter() - t
                t = time.perf_counter()
                rows = client_replay(port, str(path), reqs, a.clients, a.max_tokens)
                wall = time.perf_counter() - t
            finally:
                stop(proc)
        ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
        res["servers"][name] = {
            "command": cmd, "start_s": start_s, "wall_s": wall, "errors": sum(r["error"] is not None for r in rows),
            "ttft_total_s": float(sum(ttfts)), "ttft_p50_s": pct(ttfts, 50), "ttft_p95_s": pct(ttfts, 95),
            "ttft_max_s": max(ttfts, default=0.0), "cached_tokens": sum(r.get("cached_tokens") or 0 for r in rows),
            "rows": rows, "log_tail": logf.read_text(errors="replace")[-3000:]}
        log(f"{name}: TTFT total {res['servers'][name]['ttft_total_s']:.2f} s, "
            f"{res['servers'][name]['errors']} errors, {wall:.1f} s wall")
    k, m = res["servers"]["kvstore_serve"], res["servers"]["mlx_lm_server"]
    res["kvstore_vs_mlx_lm"] = k["ttft_total_s"] / m["ttft_total_s"] if m["ttft_total_s"] else None
    res["checks"] = {f"kvstore serve vs mlx_lm.server <= {TARGETS['serve_vs_mlx_lm']}":
                     res["kvstore_vs_mlx_lm"] is not None and res["kvstore_vs_mlx_lm"] <= TARGETS["serve_vs_mlx_lm"],
                     "0 errors": k["errors"] == 0 and m["errors"] == 0}
    (a.out / "serve.json").write_text(json.dumps(res, indent=1))
    print("| server | total TTFT s | p50 / p95 ms | cached tokens | errors |\n|---|---|---|---|---|")
    for name, s in res["servers"].items():
        print(f"| {name} | {s['ttft_total_s']:.2f} | {s['ttft_p50_s'] * 1e3:.0f} / {s['ttft_p95_s'] * 1e3:.0f} "
              f"| {s['cached_tokens']:,} | {s['errors']} |")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    is_serve = bool(argv) and argv[0] == "serve"
    ap = argparse.ArgumentParser(prog="live_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="an mlx-lm model folder, or 'tiny' (the tiny llama)")
    ap.add_argument("--trace", choices=sorted(TRACES), default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    if is_serve:
        ap.add_argument("--clients", type=int, default=8)
        ap.add_argument("--max-tokens", type=int, default=16, help="cap on each response (the trace's length below)")
        ap.add_argument("--budget-frac", type=float, default=0.25)
        a = ap.parse_args(argv[1:])
        return serve(a)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.1], help="shares of the unique KV")
    ap.add_argument("--fresh-process", action="store_true", help="each (cache, budget) in a process of its own "
                    "(else one child process runs them in turn)")
    ap.add_argument("--warm", action="store_true", help="kvstore: replay twice in one process, a new store each time")
    ap.add_argument("--ssd", action="store_true", help="kvstore: an SSD tier under --dir")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/live-replay"), help="scratch folder (SSD tiers)")
    ap.add_argument("--ssd-admit", choices=["always", "reuse"], default="always",
                    help="kvstore with --ssd: write every block to SSD, or only blocks asked for again")
    ap.add_argument("--one", nargs="+", metavar="CACHE[:BUDGET]", help=argparse.SUPPRESS)
    ap.add_argument("--budget-frac", type=float, default=0.25, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    return child(a) if a.one else parent(a)


if __name__ == "__main__":
    sys.exit(main())
