"""The live replay through the servers (issue 42): the trace's requests as text, streamed from
``--clients`` threads to ``mlx_lm.server --prompt-cache-bytes B`` and to ``kvstore serve
--prompt-cache-bytes B``, each server a process of its own; a session's turns go in order, one at a
time, as a user's would (``python -m kvstore.tools.live_replay serve``)."""

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

from .common import log, pct
from .live_summary import TARGETS
from .live_traces import SEED, load_trace


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
    """Both servers through the trace in turn; writes ``serve.json`` and prints a table."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.tools.servers import free_port, stop, wait_answering

    if a.model == "tiny":
        from kvstore.adapters.tiny_models import ensure_tiny_model

        a.model = str(ensure_tiny_model("llama"))
    path = Path(a.model)
    cfg = json.loads((path / "config.json").read_text())
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dsize = 4 if cfg.get("dtype", cfg.get("torch_dtype")) == "float32" else 2
    bpt = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * dim * dsize
    trace = load_trace(a.trace)
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
