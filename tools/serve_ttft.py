#!/usr/bin/env python
"""Time to first token through ``kvstore serve``, cold and hit, with the OpenAI client.

    python -m kvstore.tools.serve_ttft --model smollm2|gemma3|PATH --prefix 1536 --trials 3 --out ttft.json \
        [--texts-json FILE] [kvstore serve options]

``kvstore serve`` runs as its own process on an empty store. Each trial takes a
new system prompt of ``--prefix`` tokens (the head of a text from
``tools/fidelity.py``'s set, different per trial) and sends, through the
``openai`` package's streaming chat API:

1. ``cold``: the system prompt and a question: nothing stored yet.
2. ``hit``: the same system prompt and another question: mlx-lm's server
   stored the cache at the end of the system segment, and the store serves
   that prefix (``--fetch-policy always``, so a hit is always loaded and timed).

TTFT is the time from sending the request to the first streamed content
token, as a client sees it (HTTP, tokenizing, chat template, fetch, prefill).
The first request of a run also loads the model and is not counted (a warm-up
trial on another text comes first).

``--first-request N`` measures that first request instead (issue 51: it waited
on ``fetch_policy="auto"``'s calibration): N fresh starts each of ``kvstore
serve`` (default options, a new store) and ``mlx_lm server`` on the same model,
taken in turn; each is sent one short chat once ``/v1/models`` answers. Medians
of its TTFT and of start-up (launch to answering), and kvstore's TTFT over
mlx-lm's; ``--into FILE`` adds them to that JSON under ``serve_first_request``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from kvstore.tools.servers import free_port, stop, wait_answering

QUESTIONS = ("Summarize the text above in one sentence.", "Which names appear in the text above?")


def _ttft(client, model: str, system: str, question: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0.0, stream=True)
    first, text = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta and first is None:
            first = time.perf_counter() - t0
        text += delta or ""
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "text": text}


def _system_prompts(tokenizer, texts, n: int, prefix: int) -> list[tuple[str, str]]:
    """``n`` system prompts of ``prefix`` tokens each, from the fidelity texts (long enough ones)."""
    out = []
    for t in texts:
        ids = tokenizer.encode(t.text, add_special_tokens=False)
        if len(ids) >= prefix:
            out.append((t.name, tokenizer.decode(ids[:prefix])))
    if len(out) < n:
        raise ValueError(f"only {len(out)} texts have {prefix} tokens; {n} needed")
    return out[:n]


def _computed_tokens(log: str) -> list[int]:
    """Prompt tokens the server computed per request, in order, from mlx-lm's progress lines
    ('Prompt processing progress: done/total'; a hit computes only the part after the stored prefix)."""
    out, last = [], None
    for m in re.finditer(r"Prompt processing progress: (\d+)/(\d+)", log):
        done, total = int(m.group(1)), int(m.group(2))
        if done == total:
            out.append(total)
        last = (done, total)
    return out if last is None or last[0] == last[1] else out + [last[1]]


def run(model: str, prefix: int = 1536, trials: int = 3, max_tokens: int = 8, port: Optional[int] = None,
        extra: Optional[list[str]] = None, texts=None, log=print) -> dict:
    from openai import OpenAI

    from kvstore.adapters.gguf import load_model
    from kvstore.tools.fidelity import default_texts

    _, tokenizer, path = load_model(model)  # for the texts' token counts; the server loads its own
    prompts = _system_prompts(tokenizer, default_texts() if texts is None else texts, trials + 1, prefix)
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as d:
        cmd = [sys.executable, "-m", "kvstore.adapters.cli", "serve", "--model", str(path), "--port", str(port),
               "--ssd-path", str(Path(d, "store")), "--fetch-policy", "always", *(extra or [])]
        log("starting: " + " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(Path(d, "serve.log"), "w"))
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
            wait_answering(f"http://127.0.0.1:{port}/health", proc, 600, "kvstore serve")  # /v1/models needs a hub cache folder
            _ttft(client, str(path), prompts[0][1], QUESTIONS[0], max_tokens)  # warm-up: loads the model
            rows = []
            for name, system in prompts[1:]:
                cold = _ttft(client, str(path), system, QUESTIONS[0], max_tokens)
                hit = _ttft(client, str(path), system, QUESTIONS[1], max_tokens)
                rows.append({"text": name, "cold": cold, "hit": hit})
                log(f"{name}: cold {cold['ttft_s'] * 1e3:.1f} ms, hit {hit['ttft_s'] * 1e3:.1f} ms")
        finally:
            stop(proc)
            serve_log_all = Path(d, "serve.log").read_text(errors="replace")
            serve_log = serve_log_all[-4000:]
    import mlx.core as mx

    computed = _computed_tokens(serve_log_all)
    if len(computed) == 1 + 2 * len(rows):  # warm-up, then cold and hit per trial
        for i, r in enumerate(rows):
            r["cold"]["computed_tokens"], r["hit"]["computed_tokens"] = computed[1 + 2 * i], computed[2 + 2 * i]
    med = lambda k: statistics.median(r[k]["ttft_s"] for r in rows)  # noqa: E731
    return {"model": model, "model_path": str(path), "prefix_tokens": prefix, "trials": trials,
            "max_tokens": max_tokens, "device": str(mx.default_device()), "mlx": mx.__version__,
            "machine": f"{platform.system()} {platform.machine()}", "server_args": extra or [],
            "rows": rows, "cold_ttft_s_median": med("cold"), "hit_ttft_s_median": med("hit"),
            "speedup": med("cold") / med("hit"), "serve_log_tail": serve_log}


# mlx-lm's server as it is, but for kvstore serve's loader (it also reads GGUF files: SmolLM2), as both load alike
_MLX_LM_SERVER = ("import mlx_lm.server as S; from kvstore.adapters.server import _load_gguf_too; "
                  "S.load = _load_gguf_too(S.load); S.main()")


def _first(cmd: list[str], port: int, model: str, env: dict, log_path: Path) -> dict:
    """Launch ``cmd``; once ``/v1/models`` answers, one short chat: its TTFT and start-up."""
    from openai import OpenAI

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), env=env)
    try:
        wait_answering(f"http://127.0.0.1:{port}/v1/models", proc, 600, log_path.stem)
        ready = time.perf_counter() - t0
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        got = _ttft(client, model, "You are a helpful assistant.", QUESTIONS[0], 8)
    finally:
        stop(proc)
    return {"ready_s": round(ready, 3), "ttft_s": round(got["ttft_s"], 3), "total_s": round(got["total_s"], 3),
            "launch_to_first_token_s": round(ready + got["ttft_s"], 3)}


def first_request(model: str, starts: int = 5, log=print) -> dict:
    """The first request after start-up, ``kvstore serve`` against ``mlx_lm server``, ``starts`` fresh starts each."""
    import os

    from kvstore.tools.bench.calibration import load

    rows: dict[str, list] = {"kvstore": [], "mlx_lm": []}
    with tempfile.TemporaryDirectory(prefix="kvstore-first-") as d:
        _, _, path = load(model, Path(d))  # (tiny, slow6: made here)
        Path(d, "hub").mkdir()  # mlx-lm's /v1/models lists the Hugging Face cache: an empty one here
        env = dict(os.environ, HF_HUB_CACHE=str(Path(d, "hub")))
        for i in range(starts):
            for name in rows:
                port = free_port()
                cmd = [sys.executable, "-c", _MLX_LM_SERVER, "--model", str(path), "--port", str(port)]
                if name == "kvstore":
                    cmd = [sys.executable, "-m", "kvstore.adapters.cli", "serve", "--model", str(path), "--port",
                           str(port), "--ssd-path", str(Path(d, f"store{i}"))]
                rows[name].append(_first(cmd, port, str(path), env, Path(d, f"{name}{i}.log")))
                log(f"start {i} {name}: {rows[name][-1]}")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for n, rs in rows.items()}
    import mlx.core as mx

    return {"model": model, "starts": starts, "device": str(mx.default_device()), "mlx": mx.__version__,
            "cores": os.cpu_count(), "median": med, "ttft_ratio": round(med["kvstore"]["ttft_s"] /
                                                                         med["mlx_lm"]["ttft_s"], 2),
            "launch_to_first_token_ratio": round(med["kvstore"]["launch_to_first_token_s"] /
                                                 med["mlx_lm"]["launch_to_first_token_s"], 2), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="serve_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3', a GGUF file or an mlx-lm model folder")
    ap.add_argument("--prefix", type=int, default=1536, help="system prompt tokens")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--texts-json", metavar="FILE", help="texts saved by tools/fidelity.py --save-texts "
                    "(default: its texts from installed packages)")
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--first-request", type=int, metavar="N", help="N fresh starts: kvstore serve's first request "
                    "against mlx_lm server's")
    ap.add_argument("--into", help="with --first-request: add the result to this JSON under serve_first_request")
    a, extra = ap.parse_known_args(argv)
    if a.first_request:
        res = first_request(a.model, a.first_request, log=lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
        if a.into:
            into = Path(a.into)
            doc = json.loads(into.read_text()) if into.exists() else {}
            doc.setdefault("serve_first_request", {})[a.model if "/" not in a.model else "path"] = res
            into.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    from kvstore.tools.fidelity import load_texts

    texts = load_texts(Path(a.texts_json)) if a.texts_json else None
    res = run(a.model, a.prefix, a.trials, a.max_tokens, extra=extra, texts=texts,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in res.items() if k not in ("rows", "serve_log_tail")}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
