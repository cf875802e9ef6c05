"""Issue 28's table (TTFT of cold prefill and of hits from each tier, the
fetch inside a RAM hit, put's blocking time) through the public API only, so
that one lease can measure the tree before the hot-path work and this one
back to back on one machine:

    python3 -m kvstore.tools.hot_path_table --model /tmp/llama-8b --out OUT/new.json
    (cd OLD && PYTHONPATH=$PWD python3 NEW/tools/hot_path_table.py --model /tmp/llama-8b --out OUT/old.json)

OLD: a tree of commit 3214a31 (``git archive 3214a31``), with kvstore/adapters
and kvstore/tools linked in as ``tools/gpu_bench.sh`` does. Per prompt length x
KV type, each TTFT is one generated token through ``adapters.generate.generate``
(median of ``--repeats``), mlx's buffer cache emptied before every timed request:

- cold: nothing stored (``fetch_policy="never"``);
- put: ``store_cache``'s blocking time (the process's first put is the first
  row's) and put -> flushed, from a prefill made outside ``generate``;
- ram: hits from the store that took the put, its blocks in RAM (on trees with
  a device tier, that tier off), and of that the time in ``store.fetch``;
- ssd_cached: a store with no RAM tier (nor device tier), its file in the page cache;
- ssd_cold: the same, reopened after the file is dropped from the page cache;
- device (trees with a device tier): hits after a first hit left the blocks on the GPU.

Every hit is forced (``fetch_policy="always"``); ``tools/cost_bench.py`` weighs the policies.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models import cache as C

from kvstore import PrefixStore
from kvstore.adapters.generate import generate, model_key, store_cache
from kvstore.tools.bench.common import drop_page_cache

KV = {"fp16": None, "q8": 8, "q4": 4}
PARTS = ("cold", "ram", "ssd_cached", "ssd_cold", "device")
ROWS = ((32768, "fp16"), (32768, "q8"), (32768, "q4"), (8192, "fp16"), (8192, "q4"))


def _open(device_gb: float | None = None, **kw) -> PrefixStore | None:
    """A store; ``device_gb`` sets the device tier where the tree has one (None: a tree without one)."""
    if device_gb is None:
        return PrefixStore(**kw)
    try:
        return PrefixStore(device_budget_gb=device_gb, **kw)
    except TypeError:  # a tree before the device tier takes no such setting
        return None


def _on_cuda() -> bool:
    from kvstore.gpu import cuda
    return cuda.runtime() is not None


def timed_fetch(store: PrefixStore) -> list[float]:
    """Seconds of each ``store.fetch`` from now on (the store's part of a
    request's TTFT; the rest is the engine's). Here, not in bench.common, so
    that this tool runs on trees from before it (``cost_bench`` uses it too)."""
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


def _timed(model, tokenizer, store: PrefixStore, prompt: list[int], repeats: int) -> dict:
    """``repeats`` requests of ``prompt``: TTFT, time in ``store.fetch``, tokens served and from RAM."""
    spent = timed_fetch(store)
    ttft, fetched, cached, ram = [], [], [], []
    for _ in range(repeats):
        spent.clear()
        mx.clear_cache()
        r = generate(model, tokenizer, prompt, store=store, max_tokens=1)
        store.flush()  # the request's own put is written before the next is timed
        ttft.append(r.ttft_s * 1e3)
        fetched.append(sum(spent) * 1e3)
        cached.append(r.cached_tokens)
        ram.append(r.ram_tokens)
    return {"ms": statistics.median(ttft), "each_ms": [round(t, 1) for t in ttft],
            "fetch_ms": statistics.median(fetched), "fetch_each_ms": [round(t, 1) for t in fetched],
            "cached_tokens": min(cached), "ram_tokens": min(ram)}


def _row(model, tokenizer, key: str, n: int, kind: str, repeats: int, tmp: Path, parts: set[str]) -> dict:
    vocab = max(100, min(getattr(tokenizer, "vocab_size", 32000), 32000))
    prompt = [(n * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]
    path = tmp / f"store-{n}-{kind}"
    kw = dict(kv_bits=KV[kind], block_size=256, fetch_policy="always")

    def store(ram_gb: float, device_gb: float = 0) -> PrefixStore:
        """On ``path``; the device tier as given where the tree has one (off unless asked)."""
        s = _open(device_gb, budget_gb=ram_gb, ssd_path=path, **kw)
        return s if s is not None else _open(budget_gb=ram_gb, ssd_path=path, **kw)

    row: dict = {"tokens": n, "kv": kind}
    if "cold" in parts:
        with PrefixStore(budget_gb=1, fetch_policy="never") as s:
            row["cold"] = _timed(model, tokenizer, s, prompt, repeats)
    cache = C.make_prompt_cache(model)
    for i in range(0, n, 2048):  # outside generate: the put is the first the store sees
        model(mx.array(prompt[i:i + 2048])[None], cache=cache)
        mx.eval([c.state for c in cache])
    per_token = row["fp16_bytes_per_token"] = sum(c.keys.nbytes + c.values.nbytes for c in cache) \
        // cache[0].keys.shape[2]
    with store(8) as s:
        t = time.perf_counter()
        store_cache(s, key, prompt, cache)
        row["put_ms"] = (time.perf_counter() - t) * 1e3
        s.flush()
        row["put_to_flushed_ms"] = (time.perf_counter() - t) * 1e3
        del cache
        if "ram" in parts:
            ram = row["ram"] = _timed(model, tokenizer, s, prompt, repeats)
            ram["fetch_fp16_gbps"] = ram["cached_tokens"] * per_token / ram["fetch_ms"] / 1e6
    if "ssd_cached" in parts:
        with store(0) as s:
            row["ssd_cached"] = _timed(model, tokenizer, s, prompt, repeats)
    if "ssd_cold" in parts:
        cold = []
        for _ in range(repeats):
            for f in path.glob("*.mdb"):
                drop_page_cache(f)
            with store(0) as s:
                cold.append(_timed(model, tokenizer, s, prompt, 1))
        row["ssd_cold"] = {"ms": statistics.median(c["ms"] for c in cold), "each_ms": [c["ms"] for c in cold],
                           "cached_tokens": min(c["cached_tokens"] for c in cold)}
    s = _open(8, budget_gb=8, ssd_path=path, **kw) if "device" in parts and _on_cuda() else None
    if s is not None:
        with s:
            _timed(model, tokenizer, s, prompt, 2)  # the first hit lands the blocks and leaves them on the GPU
            row["device"] = _timed(model, tokenizer, s, prompt, repeats)
    shutil.rmtree(path, ignore_errors=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="mlx-lm model folder (gpu_bench.sh model: /tmp/llama-8b)")
    ap.add_argument("--rows", nargs="+", default=[f"{n}:{k}" for n, k in ROWS], help="TOKENS:KV, e.g. 8192:q4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="which TTFTs (put always runs)")
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file, rewritten after each row")
    a = ap.parse_args(argv)
    model, tokenizer = load(a.model)
    key = model_key(model)
    tmp = Path(tempfile.mkdtemp(prefix="hot-path-", dir=a.dir))
    out = {"model": a.model, "tree": str(Path.cwd()), "host": platform.node(), "repeats": a.repeats,
           "date": time.strftime("%Y-%m-%d %H:%M"), "rows": []}
    try:
        for spec in a.rows:
            n, kind = spec.split(":")
            out["rows"].append(_row(model, tokenizer, key, int(n), kind, a.repeats, tmp, set(a.parts)))
            r = out["rows"][-1]
            print(json.dumps({k: (v["ms"] if isinstance(v, dict) else v) for k, v in r.items()}), flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
