"""One process of the live replay (issue 42): the model loaded once, then each (cache, budget) asked of
it replayed through a new cache as an engine calls the public API, and written as
``replay-CACHE-BUDGET.json``; ``tools/live_replay.py`` runs this as ``--one``, in as many processes as
``--fresh-process`` asks.

Per request: TTFT = fetch + prefill of the rest + the first token (``mx.eval`` of the argmax, the model
on mlx-lm's generation stream); then the response runs through the model (teacher-forced) and prompt +
response are offered to the cache, timed alone as ``put_s`` (what the engine's thread spends in
``store_cache`` / ``insert_cache``). Caches, with B the budget in bytes: ``none``; ``lru``: mlx-lm's
``LRUPromptCache(max_bytes=B)`` (entries in GPU memory); ``kvstore_fp16`` / ``kvstore_q8``:
``PrefixStore(budget_gb=B, device_budget_gb=B, block_size=256)``, ``calibrate_once`` before the first
request (``calibrate_s``, not in TTFT), ``observe_request`` after each as the adapters do."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from . import page_cache
from .common import GiB, describe_model, log, machine, pct, run_tokens
from .live_summary import run_key
from .live_traces import describe, first_sight_tokens, load_trace, warm_up_trace
from .replay import lru_fetch


def load(model: str) -> tuple[Any, Path]:
    """(model, path): the tiny llama for "tiny", else an mlx-lm folder."""
    if model == "tiny":
        from .common import load_tiny

        m, _, path = load_tiny("llama")
        return m, path
    import mlx_lm

    return mlx_lm.load(model)[0], Path(model)


def copy_gbps(nbytes: int) -> float:
    """GB/s of ``mx.array(numpy buffer)`` evaluated and read once on the device (best of 3): a lower
    bound on the host -> device bus wherever mlx runs."""
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


def pinned_gbps(nbytes: int = GiB) -> Optional[float]:
    """GB/s of a pinned host -> device copy on the copy engine (best of 3): the bus a hit from RAM
    can use on CUDA, where mlx itself has no pinned copy; None without CUDA."""
    from kvstore.gpu import cuda

    rt = cuda.runtime()
    if rt is None:
        return None
    src = rt.pinned(nbytes)
    src[:] = 1
    best = 0.0
    with cuda.landing(nbytes) as (_, addr), cuda.one_stream(rt) as stream:
        for _ in range(3):
            t = time.perf_counter()
            rt.copy(addr, src.ctypes.data, nbytes, stream)
            rt.sync(stream)
            best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


class FullCollections:
    """Seconds in full (generation 2) garbage collections while the block runs: pauses of the engine's
    thread (a collection holds the GIL) that no request's own timer tells apart."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0

    def _hook(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)


def replay(system: str, trace: dict, model: Any, mkey: str, budget: int, ssd: Optional[Path] = None,
           ssd_admit: str = "always", profile: Optional[cProfile.Profile] = None, idle_writer: bool = False,
           drop_page_cache: Optional[str] = None) -> dict:
    """The trace through one new cache: per-request rows and the run's figures. ``profile`` (kvstore):
    what the fetches spent their time on; ``idle_writer``: flush after each put, untimed, so every
    request runs with the store's writer idle (a diagnosis, not an engine's way); ``drop_page_cache``
    (kvstore with ``ssd``; "fadvise" or "drop_caches"): the store's file out of the page cache before each
    request, untimed (``page_cache.drop``), so its SSD hits read the disk."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models import cache as C

    from kvstore import PrefixStore
    from kvstore.adapters.generate import calibrate_once, fetch_cache, store_cache

    lru = store = None
    t = time.perf_counter()
    if system == "lru":
        lru = C.LRUPromptCache(max_size=1 << 20, max_bytes=budget)
    elif system != "none":
        store = PrefixStore(budget_gb=budget / GiB, device_budget_gb=budget / GiB, block_size=256, ssd_path=ssd,
                            kv_bits=None if system == "kvstore_fp16" else 8, ssd_admit=ssd_admit)
    open_s = time.perf_counter() - t
    calibrate_s = calibrate_once(store, mkey, [model]) if store is not None else 0.0
    rows, drops = [], []
    first_sight = first_sight_tokens(trace)
    t_start = time.perf_counter()
    with FullCollections() as collections:
        for i, req in enumerate(trace["requests"]):
            ids = req["prompt"]  # int32: the store's form; mlx-lm's server keeps lists (made outside the timing)
            prompt = ids.tolist()
            row: dict[str, Any] = {"i": i, "session": req["session"], "prompt_tokens": len(prompt),
                                   "first_sight_tokens": first_sight[i], "response_tokens": len(req["response"])}
            if drop_page_cache and store is not None and ssd is not None:
                drops.append(page_cache.drop(ssd, drop_page_cache))
            t0 = time.perf_counter()
            hit = None
            if lru is not None:
                cache, got = lru_fetch(lru, model, mkey, prompt)
            elif store is not None:
                with profile if profile is not None else contextlib.nullcontext():
                    r = fetch_cache(store, model, mkey, ids)
                cache, got, hit = r.cache, r.cached_tokens, r.hit
                row.update(ram_tokens=r.ram_tokens, ssd_tokens=r.ssd_tokens,
                           source_bytes=dict(hit.source_bytes) if hit else {},
                           skipped_tokens=hit.skipped_tokens if hit else 0,
                           not_served=dict(hit.not_served) if hit is not None else {})
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
            if idle_writer and store is not None:
                store.flush()
            del cache
            row.update(cached_tokens=got, computed_tokens=len(prompt) - got, fetch_s=t1 - t0,
                       prefill_s=ttft - (t1 - t0), ttft_s=ttft, put_s=put_s if system != "none" else 0.0)
            rows.append(row)
    out: dict[str, Any] = {"system": system, "budget_bytes": budget, "open_s": open_s, "calibrate_s": calibrate_s,
                           "gc_full_s": collections.seconds}
    if drops:
        out["page_cache_drops"] = page_cache.summarize(drops)
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
               fetch_total_s=sum(r["fetch_s"] for r in rows), prefill_total_s=sum(r["prefill_s"] for r in rows),
               ttft_total_s=float(sum(ttfts)), ttft_p50_s=pct(ttfts, 50), ttft_p95_s=pct(ttfts, 95),
               ttft_max_s=max(ttfts), put_p50_s=pct(puts, 50), put_p99_s=pct(puts, 99), put_max_s=max(puts),
               rows=rows)
    return out


def repeat_prefills(trace: dict, model: Any, rows: list[dict]) -> Optional[list[float]]:
    """Each request's prefill again on the shape the round ran it on, without a cache: its cached tokens
    as KV of zeros (sized as ``KVCache`` sizes its own), then the rest of its prompt, timed as the round
    timed its prefill. The shapes are now seen, so their times are the run's compute at the engine's
    steady rate, and what the round's prefills took past them its cost of new shapes (the floor's
    terms); None where the model's cache is not plain ``KVCache`` layers."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models import cache as C

    probe = C.make_prompt_cache(model)
    if not all(type(c) is C.KVCache for c in probe):
        return None
    model(mx.array([[1]]), cache=probe)
    layers = [(c.keys.shape, c.values.shape, c.keys.dtype) for c in probe]
    out = []
    for req, row in zip(trace["requests"], rows):
        cached = row["cached_tokens"]
        cache = C.make_prompt_cache(model)
        if cached:
            cap = -(-cached // C.KVCache.step) * C.KVCache.step
            for c, (k, v, dtype) in zip(cache, layers):
                c.keys, c.values = mx.zeros((*k[:2], cap, k[3]), dtype), mx.zeros((*v[:2], cap, v[3]), dtype)
                c.offset = cached
            mx.eval([(c.keys, c.values) for c in cache])
        t = time.perf_counter()
        with mx.stream(generation_stream):
            mx.eval(mx.argmax(run_tokens(model, cache, req["prompt"][cached:])))
        out.append(time.perf_counter() - t)
        del cache
    return out


def fresh_dir(path: Optional[Path]) -> Optional[Path]:
    """``path`` emptied (a store there is new), or None."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
    return path


def warm_up(system: str, a: argparse.Namespace, model: Any, mkey: str, budget: int, measured: dict) -> dict:
    """The engine warmed before the measured round (``--rounds warm-engine``): another trace
    (``warm_up_trace``: its prompt lengths none of the measured ones) through a new cache of the
    measured kind (``--warm-up-cache same``, its SSD tier in a folder of its own) or none, then thrown
    away; what it ran, its seconds and the (cached, new tokens) pairs its requests prefilled."""
    trace, settings = warm_up_trace(a.trace, measured)
    if a.warm_up_requests:
        trace = dict(trace, requests=trace["requests"][:a.warm_up_requests])
    kind = system if a.warm_up_cache == "same" else "none"
    ssd = fresh_dir(a.dir / "ssd-warm-up") if a.ssd and kind.startswith("kvstore") else None
    t = time.perf_counter()
    r = replay(kind, trace, model, mkey, budget, ssd, a.ssd_admit)
    seconds = time.perf_counter() - t
    fresh_dir(ssd)
    gc.collect()
    return {"cache": kind, "trace": settings, "requests": r["requests"], "seconds": seconds,
            "ttft_total_s": r["ttft_total_s"], "tokens_computed": r["tokens_computed"],
            "shapes": sorted({(x["cached_tokens"], x["computed_tokens"]) for x in r["rows"]})}


def run_jobs(a: argparse.Namespace) -> int:
    """Each of ``a.one`` ("CACHE", "CACHE:BUDGET" or "CACHE:BUDGET:dropped") in turn in this process, in
    round ``a.round``, each written as its JSON (``run_key``)."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    from kvstore.adapters.generate import model_key

    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    t = time.perf_counter()
    model, path = load(a.model)
    load_s = time.perf_counter() - t
    mkey = model_key(model, path)
    trace = load_trace(a.trace)
    _, bpt = describe_model("llama", model)
    unique = trace["unique_tokens"] * bpt
    run_tokens(model, C.make_prompt_cache(model), list(range(5, 517)))  # first model run of the process
    gpu = mx.default_device().type == mx.gpu
    for item in a.one:
        system, _, rest = item.partition(":")
        frac, _, variant = rest.partition(":")
        frac = 0.0 if system == "none" else float(frac or a.budget_frac)
        budget = int(frac * unique)
        kvstore = system.startswith("kvstore")
        dropped = variant == "dropped" and kvstore and a.ssd and a.drop_page_cache is not None
        key = run_key(system, frac, a.round, dropped, a.ssd and kvstore)
        ssd = a.dir / f"ssd-{key}" if a.ssd and kvstore else None
        log(f"{key} at {frac:g} of {unique / GiB:.3f} GiB unique KV: budget {budget / GiB:.3f} GiB")
        warm = warm_up(system, a, model, mkey, budget, trace) if a.round == "warm-engine" else None
        prof = cProfile.Profile() if a.profile and kvstore else None
        res = replay(system, trace, model, mkey, budget, fresh_dir(ssd), a.ssd_admit, prof, a.idle_writer,
                     a.drop_page_cache if dropped else None)
        fresh_dir(ssd)
        if warm is not None:
            seen = {tuple(x) for x in warm.pop("shapes")}
            warm["measured_shapes_seen"] = sum((r["cached_tokens"], r["computed_tokens"]) in seen for r in res["rows"])
            res["warm_up"] = warm
        # the engine's steady time and its cost of a new shape, on this run's shapes (the floor's terms)
        res["repeat_prefill_s"] = repeat_prefills(trace, model, res["rows"])
        if a.warm and a.round == "fresh":  # the same replay on a second new cache of this (now warm) process
            gc.collect()
            ssd2 = None if ssd is None else Path(f"{ssd}-2")
            res["warm_run"] = replay(system, trace, model, mkey, budget, fresh_dir(ssd2), a.ssd_admit, None,
                                     a.idle_writer)
            fresh_dir(ssd2)
        if prof is not None:  # where the first round's fetches spent their time (the engine's thread only)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
            res["fetch_profile"] = text.getvalue()
        if kvstore:
            res.update(copy_gbps=copy_gbps((512 if gpu else 64) << 20), pinned_gbps=pinned_gbps())
        if ssd is not None:
            res["ssd_fs"] = page_cache.fs_type(a.dir)
            if res["ssd_fs"] in ("tmpfs", "ramfs"):
                log(f"--dir {a.dir} is on {res['ssd_fs']}: the SSD tier is memory and its page cache cannot drop")
        res.update(budget_frac=frac, round=a.round, page_cache_dropped=dropped, ssd=ssd is not None, load_s=load_s,
                   model=str(path), kv_bytes_per_token=bpt, unique_kv_bytes=unique, device=str(mx.default_device()),
                   machine=machine(), mlx=mx.__version__, switch_interval_s=sys.getswitchinterval(),
                   idle_writer=a.idle_writer, trace=describe(a.trace, trace))
        out = a.out / f"replay-{key}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str))
        log(f"{key}: TTFT total {res['ttft_total_s']:.2f} s, computed {res['tokens_computed']:,}, "
            f"put p99 {res['put_p99_s'] * 1e3:.1f} ms -> {out}")
        gc.collect()
    return 0
