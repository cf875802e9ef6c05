"""The shared remote tier (Redis / Valkey) over loopback: what a hit from it
costs next to a local SSD hit and a cold prefill, and what two engine
processes save by sharing one server.

    kvstore bench remote [--quick] [--only PART ...] [--out DIR] [--url redis://...] [--write-docs]

Without ``--url`` it starts its own ``redis-server`` (Debian's package) on a
free loopback port with the settings docs/remote.md recommends (``maxmemory``,
``allkeys-lru``, no persistence). Figures are medians; baselines are measured
in the same run.

Parts:

restore  fetch GB/s of a Llama-3-8B-shaped layer set (fp16 and q8 entries):
         a remote hit (a fresh store, empty SSD) vs a local SSD hit
         (page-cached), and the remote hit's parts alone: the transfer
         (pipelined HGETs of the same bytes) and the decode.
ttft     time to first token on the tiny llama: cold prefill vs a local SSD
         hit vs a remote hit.
replay   the seeded chat / agent trace of ``kvstore.tools.bench`` on two engine
         processes (real ``mlx_lm`` models), each with its own SSD store,
         without and with one shared server: tokens recomputed and TTFT.
         Requests go to the two hosts round-robin (no session affinity) or
         by session; each request's copies are sent before the next request
         is dispatched, so the figures are what sharing saves, not a race.

Writes ``DIR/remote.json``; ``--write-docs`` (or a full run) rewrites the
remote section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .common import (MiB, cold_ttft, load_tiny, log, machine, med, rand_tokens, restore_workload, run_tokens, splice,
                     stat, timed)
from .replay import make_trace
from .settings import SIZES

ROOT = Path(__file__).resolve().parents[2]  # the repository, in an editable install

PARTS = ("restore", "ttft", "replay")
CONFIG = {
    "quick": dict(repeats=3, restore=dict(layers=8, heads=8, dim=128, tokens=2048), ttft=[1024, 4096],
                  replay="quick"),
    "full": dict(repeats=5, restore=dict(layers=32, heads=8, dim=128, tokens=2048), ttft=[1024, 4096, 16384],
                 replay="quick"),
}
REDIS_SETTINGS = ["--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no"]
SECTION = ("<!-- begin remote_bench -->", "<!-- end remote_bench -->")


# ---------------------------------------------------------------- server


class Server:
    """A redis-server of our own on loopback, or the one ``--url`` names."""

    def __init__(self, url: Optional[str], tmp: Path):
        self.proc: Optional[subprocess.Popen] = None
        self.settings = "as found (--url)"
        if url is not None:
            self.url = url
            return
        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("redis-server not found: install it (apt-get install redis-server) or pass --url")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        password = os.urandom(8).hex()
        d = tmp / "redis"
        d.mkdir()
        self.proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                                      "--requirepass", password, *REDIS_SETTINGS, "--logfile", "redis.log"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.settings = " ".join(a if a else '""' for a in REDIS_SETTINGS)
        self.url = f"redis://:{password}@127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                self.version()
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)

    def _tier(self):
        from kvstore.tiers.remote.tier import RemoteTier

        tier = RemoteTier(self.url, timeout=5.0)
        tier.connect()
        return tier

    def flush(self) -> None:
        tier = self._tier()
        try:
            tier.reads.flushall()
        finally:
            tier.close()

    def version(self) -> str:
        tier = self._tier()
        try:
            info = tier.node_infos("server")[0]
        finally:
            tier.close()
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info.get('redis_version')}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------- restore


def bench_restore(cfg: dict, R: int, tmp: Path, server: Server) -> dict:
    from kvstore import PrefixStore
    from kvstore.gpu import buffers
    from kvstore.blocks.hashing import KeyChain, root_key
    from kvstore.tiers.remote.tier import RemoteTier
    from kvstore.blocks.wire import deserialize

    c, layers, toks, out_bytes = restore_workload(cfg)
    key = "remote-bench-restore"
    res: dict[str, Any] = {"shape": dict(c, block_size=256, dtype="float16"), "fp16_bytes": out_bytes, "entries": {}}
    log(f"restore: {c['layers']} layers x {c['heads']} heads x {c['dim']} dim x {c['tokens']} tokens "
        f"= {out_bytes / MiB:.0f} MiB fp16")
    for bits in (None, 8):
        name = "fp16" if bits is None else "q8"
        quant = None if bits is None else (bits, 64)  # q8 handed over as Quantized: the CPU dequantize is not I/O
        server.flush()
        src = tmp / f"src-{name}"
        with PrefixStore(budget_gb=64, ssd_path=src, block_size=256, kv_bits=bits, remote=server.url) as s:
            s.put(key, toks, layers)
            s.flush()
            stored = s.nbytes
            assert s.stats()["remote_blocks_written"] == c["tokens"] // 256
        e: dict[str, Any] = {"stored_bytes": stored}
        # local SSD, page-cached: nothing promoted (budget 0), every fetch reads LMDB
        with PrefixStore(budget_gb=0, ssd_path=src) as s:
            assert s.fetch(key, toks, quantized=quant).ssd_tokens == len(toks)
            e["ssd_page_cached"] = stat(timed(lambda: s.fetch(key, toks, quantized=quant), R, warmup=1), stored)
        # remote: each fetch on a fresh store with an empty SSD directory (its blocks then go to RAM and LMDB),
        # round by round with the transfer alone -- the same payloads read as the tier reads them (streamed, in
        # round trips of remote_read_bytes) on a warm connection, and through plain redis-py (hiredis), pipelined
        # per 64 MiB -- so that all see the same load on a shared machine. Every timing is of the call alone: a
        # store is closed (its background LMDB copy written) before the next one is timed
        tier = RemoteTier(server.url)
        tier.connect()
        chain = KeyChain(root_key(key), toks, 256)
        keys = [chain.key(i) for i in range(len(toks) // 256)]
        sizes = [stored // len(keys)] * len(keys)
        ts: dict[str, list[float]] = {"remote_to_ram_and_ssd": [], "remote_to_ram": [], "client_hget": [],
                                      "redis_py_hget": []}
        for i in range(R + 1):
            for label, with_ssd in (("remote_to_ram_and_ssd", True), ("remote_to_ram", False)):
                path = tmp / f"fresh-{name}-{label}-{i}" if with_ssd else None
                s = PrefixStore(budget_gb=64, ssd_path=path, remote=server.url)
                t0 = time.perf_counter()
                hit = s.fetch(key, toks, quantized=quant)
                dt = time.perf_counter() - t0
                assert hit.remote_tokens == len(toks), (hit.length, hit.remote_tokens)
                del hit
                s.close()
                if path is not None:
                    shutil.rmtree(path)
                if i:
                    ts[label].append(dt)  # the first fetch of the process warms its threads up
            t0 = time.perf_counter()
            bufs = tier.payloads(keys, sizes)
            if i:
                ts["client_hget"].append(time.perf_counter() - t0)
            # handed back as a closing store's RAM tier hands back the blocks a hit read: dropped, they left
            # the next round's first hit (the one compared) fresh buffers to fault in, the others reused ones
            for b in bufs:
                buffers.give_back(b)
            bufs = None
            t0 = time.perf_counter()
            plain_hget(tier, keys, sizes)
            if i:
                ts["redis_py_hget"].append(time.perf_counter() - t0)
        for label, t in ts.items():
            e[label] = stat(t, stored)
        # decoding those payloads (header, checksum, key, one copy into fresh mlx arrays), as a remote hit does
        bufs = tier.payloads(keys, sizes)
        e["decode"] = stat(timed(lambda: [deserialize(b, i * 256, key=k) for i, (k, b) in enumerate(zip(keys, bufs))],
                                 R, warmup=1), stored)
        bufs = None  # (freed before the next entry)
        tier.close()
        shutil.rmtree(src)
        e["ratio"] = {"remote_vs_ssd_page_cached": e["ssd_page_cached"]["median_s"] / e["remote_to_ram_and_ssd"]["median_s"],
                      "remote_vs_client_ceiling": e["client_hget"]["median_s"] / e["remote_to_ram_and_ssd"]["median_s"],
                      "remote_vs_redis_py": e["redis_py_hget"]["median_s"] / e["remote_to_ram_and_ssd"]["median_s"],
                      # the same, round by round (each hit against the transfer measured next to it)
                      "remote_vs_client_ceiling_paired": med([c / h for c, h in zip(ts["client_hget"],
                                                                                   ts["remote_to_ram_and_ssd"])])}
        res["entries"][name] = e
        log(f"restore {name}: remote {e['remote_to_ram_and_ssd']['gbps']:.2f} GB/s (RAM only "
            f"{e['remote_to_ram']['gbps']:.2f}), SSD page-cached {e['ssd_page_cached']['gbps']:.2f}, "
            f"client ceiling {e['client_hget']['gbps']:.2f}; hit vs ceiling "
            f"{e['ratio']['remote_vs_client_ceiling']:.2f}x (paired {e['ratio']['remote_vs_client_ceiling_paired']:.2f}x); "
            f"plain redis-py {e['redis_py_hget']['gbps']:.2f} GB/s, hit vs it {e['ratio']['remote_vs_redis_py']:.2f}x")
        gc.collect()
    return res


def plain_hget(tier, keys: list, sizes: list) -> list:
    """The payloads as a plain redis-py client reads them (hiredis makes each a ``bytes``), pipelined per
    64 MiB (round trips one after another)."""
    from kvstore.tiers.remote.tier import FIELD_PAYLOAD, _chunks
    return [p for chunk in _chunks(keys, sizes, 64 << 20)
            for p in tier._each(tier.reads, "hget", [tier.key_name(k) for k in chunk], FIELD_PAYLOAD)]


# ------------------------------------------------------------------ ttft


def bench_ttft(cfg: dict, R: int, tmp: Path, server: Server) -> dict:
    from kvstore import PrefixStore
    from kvstore.adapters.generate import generate, model_key, store_cache

    model, tok, path = load_tiny("llama")
    mkey = model_key(model, path)
    rng = np.random.default_rng(40)
    res: dict[str, Any] = {"model": "tiny llama (2 layers, 1 KV head, head_dim 64, fp16)", "lengths": {}}
    for n in cfg["ttft"]:
        prompt = rand_tokens(rng, n).tolist()
        log(f"ttft: {n} tokens")
        cold, cache, first = cold_ttft(model, tok, prompt, R)
        full = prompt + [first]
        server.flush()
        src = tmp / f"ttft-{n}"
        with PrefixStore(budget_gb=4, ssd_path=src, block_size=256, remote=server.url) as s:
            store_cache(s, mkey, full, cache)
            s.flush()
        e: dict[str, Any] = {"cold": stat(cold)}
        for label in ("ssd", "remote"):
            ts, got = [], 0
            for i in range(R):
                p = src if label == "ssd" else tmp / f"ttft-{n}-fresh-{i}"
                s = PrefixStore(budget_gb=4, ssd_path=p, block_size=256, remote=server.url if label == "remote" else None)
                g = generate(model, tok, prompt, store=s, max_tokens=1)
                ts.append(g.ttft_s)
                got = g.remote_tokens if label == "remote" else g.ssd_tokens
                s.close()
                if label == "remote":
                    shutil.rmtree(p)
            e[label] = dict(stat(ts), cached_tokens=got)
        shutil.rmtree(src)
        base = e["cold"]["median_s"]
        e["speedup_vs_cold"] = {k: base / e[k]["median_s"] for k in ("ssd", "remote")}
        e["remote_vs_ssd_time"] = e["remote"]["median_s"] / e["ssd"]["median_s"]
        res["lengths"][str(n)] = e
        log(f"ttft {n}: cold {base * 1e3:.0f} ms, SSD hit {e['ssd']['median_s'] * 1e3:.0f} ms, remote hit "
            f"{e['remote']['median_s'] * 1e3:.0f} ms")
        del cache
        gc.collect()
    return res


# ---------------------------------------------------------------- replay


def bench_replay(cfg: dict, tmp: Path, server: Server) -> dict:
    trace = make_trace(SIZES[cfg["replay"]]["replay"])
    reqs = trace["requests"]
    res: dict[str, Any] = {"trace": cfg["replay"], "requests": len(reqs), "prompt_tokens": trace["prompt_tokens"],
                           "ideal_recomputed_tokens": trace["prompt_tokens"] - trace["ideal_cached_tokens"],
                           "runs": {}}
    log(f"replay: {len(reqs)} requests, {trace['prompt_tokens']:,} prompt tokens on two engine processes")
    for routing in ("round_robin", "by_session"):
        for system in ("own_stores", "shared_redis"):
            server.flush()
            url = server.url if system == "shared_redis" else None
            hosts = [_Worker(tmp / f"{routing}-{system}-{h}", url, cfg["replay"]) for h in range(2)]
            try:
                t0 = time.perf_counter()
                per = []
                for i, r in enumerate(reqs):
                    h = i % 2 if routing == "round_robin" else r["session"] % 2
                    per.append(hosts[h].ask({"i": i}))
                wall = time.perf_counter() - t0
                stats = [w.ask({"stats": True}) for w in hosts]
            finally:
                for w in hosts:
                    w.close()
            cached = sum(p["cached"] for p in per)
            run = {"recomputed_tokens": trace["prompt_tokens"] - cached, "cached_tokens": cached,
                   "remote_tokens": sum(p["remote"] for p in per), "ttft_total_s": sum(p["ttft"] for p in per),
                   "ttft_p50_s": med([p["ttft"] for p in per]), "wall_s": wall,
                   "remote_bytes_written": sum(s.get("remote_bytes_written", 0) for s in stats),
                   "remote_bytes_read": sum(s.get("remote_bytes_read", 0) for s in stats)}
            res["runs"][f"{routing}/{system}"] = run
            log(f"replay {routing} {system}: recomputed {run['recomputed_tokens']:,} tokens "
                f"(remote hits {run['remote_tokens']:,}), TTFT total {run['ttft_total_s']:.1f} s")
        own, shared = res["runs"][f"{routing}/own_stores"], res["runs"][f"{routing}/shared_redis"]
        res[f"{routing}_recompute_shared_vs_own"] = shared["recomputed_tokens"] / max(1, own["recomputed_tokens"])
        res[f"{routing}_ttft_shared_vs_own"] = shared["ttft_total_s"] / own["ttft_total_s"]
    return res


class _Worker:
    """One engine process (``--worker``): requests in, counts out, over pipes."""

    def __init__(self, ssd: Path, url: Optional[str], trace: str):
        cmd = [sys.executable, "-m", "kvstore.tools.bench.remote", "--worker", "--ssd", str(ssd), "--trace", trace]
        if url:
            cmd += ["--url", url]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a worker process died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def worker(ssd: str, url: Optional[str], trace_name: str) -> int:
    """Serve requests of the trace by index, as one engine host would."""
    import mlx.core as mx

    from kvstore import PrefixStore
    from kvstore.adapters.generate import fetch_cache, model_key, store_cache

    trace = make_trace(SIZES[trace_name]["replay"])
    model, _, path = load_tiny("llama")
    mkey = model_key(model, path)
    store = PrefixStore(budget_gb=1, ssd_path=ssd, block_size=256, kv_bits=8, remote=url)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("stats"):
            out = {k: v for k, v in store.stats().items() if isinstance(v, (int, float))}
        else:
            req = trace["requests"][msg["i"]]
            prompt = req["prompt"].tolist()
            t0 = time.perf_counter()
            r = fetch_cache(store, model, mkey, prompt)
            logits = run_tokens(model, r.cache, prompt[r.cached_tokens:])
            mx.eval(mx.argmax(logits))
            ttft = time.perf_counter() - t0
            run_tokens(model, r.cache, req["response"].tolist(), logits=False)
            store_cache(store, mkey, prompt + req["response"].tolist(), r.cache)
            store.flush()  # its copies reach the server before the next request is dispatched
            out = {"cached": r.cached_tokens, "remote": r.remote_tokens, "ttft": ttft}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    store.close()
    return 0


# ------------------------------------------------------------------ docs


def write_docs(results: dict, meta: dict, docs: Path) -> Path:
    """The remote section of ``docs/benchmarks.md`` (between ``SECTION``'s markers), from the results."""
    L: list[str] = [SECTION[0], "## remote: a shared tier on Redis over loopback\n"]
    a = L.append
    a(f"`kvstore bench remote{' --quick' if meta['mode'] == 'quick' else ''}` (it starts its own redis-server; "
      "`--url redis://...` uses a server of yours, `--only restore ttft replay` some parts): "
      f"{meta['mode']} run of {meta['date']} ({meta['runtime_s'] / 60:.1f} min) on {meta['machine']}; "
      f"{meta['server']} on loopback ({meta['settings']}), redis-py {meta['redis_py']}"
      f"{' + hiredis' if meta['hiredis'] else ''}. Medians, baselines in the same run. Server, client and engine "
      "share the machine's cores, so loopback here is a floor, not what a network and a server of its own give.\n")
    p = results.get("restore")
    if p:
        sh = p["shape"]
        a(f"**Restore**, GB/s of stored bytes: {sh['layers']} layers x {sh['heads']} KV heads x {sh['dim']} x "
          f"{sh['tokens']} tokens ({p['fp16_bytes'] / MiB:.0f} MiB fp16, block 256; q8 handed over as `Quantized`). "
          "Remote hit: a fresh store with an empty SSD, every block from the server. Timed round by round with it, "
          "on the same bytes: the tier's transfer alone (its streamed reads into reused buffers) and plain redis-py "
          "(pipelined); decode, apart: checking and copying the payloads into fresh mlx arrays. Hit / transfer is "
          "the median of each round's ratio.\n")
        a("| entries | MiB | remote hit (RAM + SSD) | remote hit (RAM only) | local SSD, cached | transfer alone "
          "| redis-py | decode | hit / transfer | hit / redis-py |")
        a("|---|---|---|---|---|---|---|---|---|---|")
        for name, e in p["entries"].items():
            a(f"| {name} | {e['stored_bytes'] / MiB:.0f} | {e['remote_to_ram_and_ssd']['gbps']:.2f} | "
              f"{e['remote_to_ram']['gbps']:.2f} | {e['ssd_page_cached']['gbps']:.2f} | "
              f"{e['client_hget']['gbps']:.2f} | {e['redis_py_hget']['gbps']:.2f} | {e['decode']['gbps']:.2f} | "
              f"{e['ratio']['remote_vs_client_ceiling_paired']:.2f}x | {e['ratio']['remote_vs_redis_py']:.2f}x |")
        a("")
    p = results.get("ttft")
    if p:
        a(f"**TTFT** on the {p['model']}: cold prefill, a hit from the local SSD store (reopened), a hit from the "
          "server (a fresh store, empty SSD).\n")
        a("| prompt tokens | cold | local SSD hit | remote hit | remote hit vs cold | remote / SSD |")
        a("|---|---|---|---|---|---|")
        for n, e in p["lengths"].items():
            a(f"| {int(n):,} | {e['cold']['median_s'] * 1e3:,.0f} ms | {e['ssd']['median_s'] * 1e3:.1f} ms | "
              f"{e['remote']['median_s'] * 1e3:.1f} ms | {e['speedup_vs_cold']['remote']:.0f}x faster | "
              f"{e['remote_vs_ssd_time']:.2f}x |")
        a("")
    p = results.get("replay")
    if p:
        a(f"**Replay on two engine processes**: the suite's `{p['trace']}` trace ({p['requests']} requests, "
          f"{p['prompt_tokens']:,} prompt tokens) on the tiny llama, each process with its own q8 SSD store, without "
          "and with one shared server. Round-robin sends a conversation's consecutive requests to alternate hosts; "
          "by-session keeps a conversation on one host. One cache of unbounded size would recompute "
          f"{p['ideal_recomputed_tokens']:,} tokens; sharing one server recomputes "
          f"{p['round_robin_recompute_shared_vs_own']:.2f}x (round-robin) and {p['by_session_recompute_shared_vs_own']:.2f}x "
          f"(by session) of two separate stores' tokens, in {p['round_robin_ttft_shared_vs_own']:.2f}x and "
          f"{p['by_session_ttft_shared_vs_own']:.2f}x the total TTFT (token counts repeat exactly; TTFT totals of "
          "seconds on a shared box move by tens of percent).\n")
        a("| routing | stores | tokens recomputed | tokens from the server | total TTFT | p50 TTFT |")
        a("|---|---|---|---|---|---|")
        for k, r in p["runs"].items():
            routing, system = k.split("/")
            a(f"| {routing.replace('_', '-')} | {'own SSD store each' if system == 'own_stores' else 'own + shared Redis'}"
              f" | {r['recomputed_tokens']:,} | {r['remote_tokens']:,} | {r['ttft_total_s']:.1f} s | "
              f"{r['ttft_p50_s'] * 1e3:.0f} ms |")
        a("")
    a(SECTION[1])
    path = docs / "benchmarks.md"
    splice(path, SECTION, "\n".join(L))
    return path


# ------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvstore bench remote", description="kvstore's remote tier (see the docstring).")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes on 2 cores)")
    ap.add_argument("--only", nargs="+", choices=PARTS, metavar="PART", help=f"parts: {', '.join(PARTS)}")
    ap.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    ap.add_argument("--url", help="use this server instead of starting one (it is FLUSHALLed!)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--tmp", help="where SSD stores go (default: system temp)")
    ap.add_argument("--write-docs", action="store_true", help="rewrite the remote section of docs/benchmarks.md")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ssd", help=argparse.SUPPRESS)
    ap.add_argument("--trace", default="quick", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.ssd, args.url, args.trace)
    import mlx.core as mx
    import redis

    mode = "quick" if args.quick else "full"
    cfg = CONFIG[mode]
    R = args.repeats or cfg["repeats"]
    parts = list(args.only) if args.only else list(PARTS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-remote-bench-", dir=args.tmp))
    server = Server(args.url, tmp)
    has_hiredis = importlib.util.find_spec("hiredis") is not None  # (redis-py parses with it when installed)
    meta = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "mlx": mx.__version__,
            "python": platform.python_version(), "server": server.version(), "settings": server.settings,
            "redis_py": redis.__version__, "hiredis": has_hiredis, "repeats": R}
    results: dict[str, Any] = {}
    t_all = time.perf_counter()
    try:
        for part in parts:
            t0 = time.perf_counter()
            if part == "restore":
                r = bench_restore(cfg, R, tmp, server)
            elif part == "ttft":
                r = bench_ttft(cfg, R, tmp, server)
            else:
                r = bench_replay(cfg, tmp, server)
            r["runtime_s"] = time.perf_counter() - t0
            results[part] = r
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    meta["runtime_s"] = time.perf_counter() - t_all
    (out / "remote.json").write_text(json.dumps({"meta": meta, "parts": results}, indent=1, default=str))
    if args.write_docs or (mode == "full" and not args.only):
        log(f"wrote {write_docs(results, meta, Path(args.docs))}")
    log(f"total {meta['runtime_s']:.1f} s; results in {out}/remote.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
