"""The live replay's runs side by side (issues 42 and 54): each run's figures (its second round's too,
under ``--warm``), its ratios to LRU and fp16 of the same round and budget and to its floor, the
issues' checks, and the tables ``live_replay.py`` prints.

A run is one (cache, budget) in one round: ``fresh`` (the first replay of a fresh process) or
``warm-engine`` (after a warm-up on another trace), its kvstore runs with the page cache as the OS left
it or dropped before each request, with an SSD tier or RAM only (``run_key``:
``kvstore_fp16-0.25@warm-engine+ssd+dropped``).

The floor of a run (issue 54): its prompts' first-sight tokens (``first_sight_tokens``: what no cache
could have had) at the run's steady prefill rate, + the bytes its hits served (``Hit.source_bytes``)
at ``bus_gbps`` (the fastest of an ``mx.array(numpy)`` copy, a pinned copy on CUDA and the store's own
measured RAM fetch rate), + the engine's cost of a new shape for each request. The rate and that cost
are measured in the run's own process (``engine``): after its round it prefills each request again on
the same shape without a cache (``repeat_prefill_s``: KV of zeros for the cached tokens), so the rate
is its computed tokens over those seconds and a new shape costs what the round's prefills took past
them, per request (a second round, its shapes seen: its own prefill rate, no new shapes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

SYSTEMS = ("none", "lru", "kvstore_fp16", "kvstore_q8")
ROUNDS = ("fresh", "warm-engine")
# the issues' "must hold" (H200 or H100, 8B shape): kvstore / LRU per budget, and the rest
TARGETS = {"vs_lru": {0.25: 0.6, 0.1: 0.5}, "vs_floor": 1.25, "q8_vs_fp16": 1.1, "fresh_vs_warm": 1.1,
           "vs_cold": 1.1, "put_p99_s": 2e-3, "put_max_s": 10e-3, "serve_vs_mlx_lm": 0.5, "dropped_vs_ram_only": 1.0}
# one replay's own figures (a run's first round, or its warm_run)
ROUND_KEYS = ("ttft_total_s", "ttft_p50_s", "ttft_p95_s", "ttft_max_s", "tokens_computed", "bytes_served",
              "fetch_total_s", "prefill_total_s", "put_p50_s", "put_p99_s", "put_max_s", "gc_full_s", "wall_s",
              "open_s", "calibrate_s", "flush_s", "page_cache_drops")
# the store's counters that say where a round's time went (the writer, the fetches that waited for it, pinning)
STAT_KEYS = ("puts_skipped", "puts_superseded", "blocks_skipped", "evictions_ram", "writer_us", "fetch_waited_us",
             "pinned_made_bytes", "pinned_made_s", "pageable_past_cap_bytes")


def run_name(system: str, frac: float) -> str:
    return "none" if system == "none" else f"{system}-{frac:g}"


def run_key(system: str, frac: float, rnd: str = "fresh", dropped: bool = False, ssd: bool = False) -> str:
    """A run's name: its cache and budget, then its round unless fresh, "ssd" where the store had an SSD tier
    and "dropped" where its page cache was."""
    tags = ([] if rnd == "fresh" else [rnd]) + (["ssd"] if ssd else []) + (["dropped"] if dropped else [])
    return run_name(system, frac) + ("@" + "+".join(tags) if tags else "")


def engine(r: Optional[dict]) -> Optional[dict]:
    """A replay's steady prefill rate (its computed tokens over its prefills repeated on the same
    shapes, ``repeat_prefill_s``) and the engine's cost of a new shape per request (what its prefills
    took past those, on average); without them (a second round, whose shapes are all seen), its own
    prefill rate and no new shapes."""
    if not r:
        return None
    rows, repeat = r["rows"], r.get("repeat_prefill_s")
    if not repeat:
        return {"steady_tok_per_s": r["tokens_computed"] / r["prefill_total_s"], "new_shape_s": 0.0,
                "from": "its round's prefills (shapes seen)"}
    return {"steady_tok_per_s": r["tokens_computed"] / sum(repeat),
            "new_shape_s": sum(x["prefill_s"] - t for x, t in zip(rows, repeat)) / len(rows),
            "from": "its prefills repeated"}


def _round(r: dict, none: Optional[dict], bus: list[Optional[float]]) -> dict:
    """One replay's figures, each request against the cold one (``none``'s replay of the same round),
    and its floor (``bus``: the process's measured copy rates; module docstring)."""
    s: dict[str, Any] = {k: r.get(k) for k in ROUND_KEYS if r.get(k) is not None}
    if none:
        ratios = [x["ttft_s"] / c["ttft_s"] for x, c in zip(r["rows"], none["rows"])]
        s["vs_cold_max"], s["vs_cold_over_1_1"] = max(ratios), sum(x > TARGETS["vs_cold"] for x in ratios)
    if all("first_sight_tokens" in x for x in r["rows"]):
        s["first_sight_tokens"] = sum(x["first_sight_tokens"] for x in r["rows"])
        s["first_sight_le_computed"] = all(x["first_sight_tokens"] <= x["computed_tokens"] for x in r["rows"])
    stats = r.get("store_stats")
    if stats:
        s.update({k: stats[k] for k in STAT_KEYS if k in stats})
        s["ssd_tokens"] = sum(x.get("ssd_tokens", 0) for x in r["rows"])
        s["bytes_by_source"] = {}  # ram, ssd_cached, ssd_cold: where the cost model found each block served
        for x in r["rows"]:
            for k, v in x.get("source_bytes", {}).items():
                s["bytes_by_source"][k] = s["bytes_by_source"].get(k, 0) + v
        s["not_served"] = {k: v for k, v in stats.get("tokens_not_served", {}).items() if v}
        # every request: the tokens served plus those not served, by reason, are its prompt's
        s["reasons_add_up"] = all(x["cached_tokens"] + sum(x.get("not_served", {}).values()) == x["prompt_tokens"]
                                  for x in r["rows"])
        ram = stats["cost"]["rates"].get("ram", {})
        s["store_ram_gbps"] = ram.get("gb_per_s") if ram.get("observed") else None
        s["bus_gbps"] = max(x for x in (*bus, s["store_ram_gbps"]) if x)
    eng = engine(r)
    if "first_sight_tokens" in s:
        s["steady_tok_per_s"], s["new_shape_s"] = eng["steady_tok_per_s"], eng["new_shape_s"]
        s["floor_s"] = (s["first_sight_tokens"] / eng["steady_tok_per_s"]
                        + len(r["rows"]) * max(0.0, eng["new_shape_s"])
                        + (r["bytes_served"] / (s["bus_gbps"] * 1e9) if stats else 0.0))
        s["vs_floor"] = r["ttft_total_s"] / s["floor_s"]
    return s


def _ratios(runs: dict[str, dict], prefix: str) -> None:
    """vs LRU, q8 vs fp16, dropped vs page-cached and SSD vs RAM only, run against the runs of its round
    and budget, for the replay whose keys start with ``prefix``."""
    total = prefix + "ttft_total_s"
    for s in runs.values():
        if not s.get(total):
            continue
        frac, rnd, dropped, ssd = s["budget_frac"], s["round"], s["page_cache"] == "dropped", s["ssd"]
        lru = runs.get(run_key("lru", frac, rnd))
        if lru and lru.get(total) and s["system"] not in ("lru", "none"):
            s[prefix + "vs_lru"] = s[total] / lru[total]
        fp16 = runs.get(run_key("kvstore_fp16", frac, rnd, dropped, ssd))
        if fp16 and fp16.get(total) and s["system"] == "kvstore_q8":
            s[prefix + "vs_fp16"] = s[total] / fp16[total]
        cached = runs.get(run_key(s["system"], frac, rnd, ssd=True))
        if dropped and cached and cached.get(total):
            s[prefix + "vs_page_cached"] = s[total] / cached[total]
        ram_only = runs.get(run_key(s["system"], frac, rnd))
        if ssd and ram_only and ram_only.get(total):
            s[prefix + "vs_ram_only"] = s[total] / ram_only[total]


def _checks(out: dict) -> None:
    """The issues' checks, per run (the page cache's drops where dropped)."""
    checks = out["checks"]
    for name, s in out["runs"].items():
        if "first_sight_le_computed" in s:
            checks[f"{name} computes at least its first-sight tokens, every request"] = s["first_sight_le_computed"]
        if not s["system"].startswith("kvstore"):
            continue
        want = TARGETS["vs_lru"].get(round(s["budget_frac"], 2))
        if want and "vs_lru" in s:
            checks[f"{name} vs lru <= {want}"] = s["vs_lru"] <= want
        if "vs_floor" in s:
            checks[f"{name} vs floor <= {TARGETS['vs_floor']}"] = s["vs_floor"] <= TARGETS["vs_floor"]
        if "vs_fp16" in s:
            checks[f"{name} vs fp16 <= {TARGETS['q8_vs_fp16']}"] = s["vs_fp16"] <= TARGETS["q8_vs_fp16"]
        if "fresh_vs_warm" in s:
            want = TARGETS["fresh_vs_warm"]
            checks[f"{name} fresh vs warm <= {want}"] = s["fresh_vs_warm"] <= want
        if "vs_cold_max" in s:
            checks[f"{name} no request over {TARGETS['vs_cold']}x cold"] = s["vs_cold_over_1_1"] == 0
        if "reasons_add_up" in s:
            checks[f"{name} served + not served = prompt, every request"] = s["reasons_add_up"]
        if "fetch_waited_us" in s:
            checks[f"{name} no fetch waits for the writer"] = s["fetch_waited_us"] == 0
        if "page_cache_drops" in s:
            checks[f"{name} page cache dropped before every request"] = s["page_cache_drops"]["worked"]
        if s["page_cache"] == "dropped" and "vs_ram_only" in s:
            want = TARGETS["dropped_vs_ram_only"]
            checks[f"{name} vs RAM only <= {want}"] = s["vs_ram_only"] <= want
        checks[f"{name} put p99 <= 2 ms, max <= 10 ms"] = (s["put_p99_s"] <= TARGETS["put_p99_s"]
                                                          and s["put_max_s"] <= TARGETS["put_max_s"])


def summarize(runs: dict[str, dict]) -> dict:
    """Ratios, floors and the issues' checks from the runs' JSON (keyed by ``run_key``); a run's second
    round (``warm_run``) has the same figures under ``warm_`` keys."""
    nones = {rnd: runs.get(run_key("none", 0, rnd)) for rnd in ROUNDS}
    out: dict[str, Any] = {"engine": {}, "runs": {}, "checks": {}}
    for rnd, none in nones.items():
        if none:
            out["engine"][rnd] = engine(none)
            if none.get("warm_run"):
                out["engine"][rnd + " (second round)"] = engine(none["warm_run"])
    for name, r in runs.items():
        rnd = r.get("round", "fresh")
        none = nones.get(rnd)
        bus = [r.get("copy_gbps"), r.get("pinned_gbps")]
        s = {"system": r["system"], "budget_frac": r["budget_frac"], "round": rnd,
             "page_cache": "dropped" if r.get("page_cache_dropped") else "as left", "ssd": bool(r.get("ssd")),
             "load_s": r.get("load_s"), "copy_gbps": bus[0], "pinned_gbps": bus[1], **_round(r, none, bus)}
        if r.get("warm_up"):
            s["warm_up"] = r["warm_up"]
        if r.get("warm_run"):
            s.update({f"warm_{k}": v for k, v in _round(r["warm_run"], none and none.get("warm_run"), bus).items()})
            s["fresh_vs_warm"] = r["ttft_total_s"] / s["warm_ttft_total_s"]
        out["runs"][name] = s
    _ratios(out["runs"], "")
    _ratios(out["runs"], "warm_")
    _checks(out)
    return out


def _f(x: Any, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "" if x is None else fmt.format(x * scale)


def _variant(s: dict) -> str:
    return s["round"] + (", dropped" if s["page_cache"] == "dropped" else "")


def _cell(s: dict) -> str:
    """A run's total TTFT and its ratios to LRU and its floor."""
    ratios = [f"{s[k]:.2f}{unit}" for k, unit in (("vs_lru", " LRU"), ("vs_floor", "x floor"),
                                                    ("vs_ram_only", " RAM only")) if k in s]
    return f"{s['ttft_total_s']:.2f}" + (f" ({', '.join(ratios)})" if ratios else "")


def _drops(pc: Optional[dict]) -> str:
    """A run's page-cache drops: how many, the file's cached share before -> after / dirty / clean."""
    if not pc:
        return ""
    shares = " / ".join(_f(pc.get(k), "{:.0%}") for k in ("cached_after_mean", "dirty_after_mean", "clean_after_mean"))
    return f"{pc['drops']}, {_f(pc.get('cached_before_mean'), '{:.0%}')} -> {shares} ({', '.join(pc['methods'])})"


def table(summary: dict) -> str:
    """The summary as markdown: total TTFT per cache and budget in each round (vs LRU; vs floor); each
    run's figures; the stores' tokens not served by reason and their writers' skips; the engine's rates."""
    runs = summary["runs"]
    variants = list(dict.fromkeys(_variant(s) for s in sorted(runs.values(), key=lambda s: (
        ROUNDS.index(s["round"]), s["page_cache"]))))
    rows: dict[tuple, dict] = {}
    for s in runs.values():
        rows.setdefault((s["system"], s["ssd"], s["budget_frac"]), {})[_variant(s)] = s
    out = ["| cache | B | " + " | ".join(f"{v}: total TTFT s (vs LRU, vs floor)" for v in variants) + " |",
           "|---|---|" + "---|" * len(variants)]
    order = sorted(rows.items(), key=lambda kv: (kv[0][0] != "none", -kv[0][2], SYSTEMS.index(kv[0][0]), kv[0][1]))
    for (system, ssd, frac), by in order:
        cells = [_cell(by[v]) if v in by else "" for v in variants]
        out.append(f"| {system}{' + SSD' if ssd else ''} | {_f(frac or None, '{:.0%}')} | " + " | ".join(cells) + " |")
    second = any("warm_ttft_total_s" in s for s in runs.values())
    out += ["", "| run | total TTFT s | p50 / p95 / max ms | tokens computed | first sight | floor s | new shape ms "
            "| fetch s | put p50 / p99 / max ms | max vs cold | warm-up s (requests, shapes seen) |"
            + (" round 2 s (vs LRU) |" if second else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if second else "")]
    for name, s in runs.items():
        ttft = " / ".join(_f(s.get(k), "{:.0f}", 1e3) for k in ("ttft_p50_s", "ttft_p95_s", "ttft_max_s"))
        put = " / ".join(_f(s.get(k), "{:.2f}", 1e3) for k in ("put_p50_s", "put_p99_s", "put_max_s"))
        w = s.get("warm_up")
        warm = "" if not w else f"{w['seconds']:.2f} ({w['requests']}, {w['measured_shapes_seen']})"
        line = (f"| {name} | {s['ttft_total_s']:.2f} | {ttft} | {s['tokens_computed']:,} "
                f"| {_f(s.get('first_sight_tokens'), '{:,.0f}')} | {_f(s.get('floor_s'))} "
                f"| {_f(s.get('new_shape_s'), '{:.1f}', 1e3)} | {_f(s.get('fetch_total_s'))} | {put} "
                f"| {_f(s.get('vs_cold_max'))} | {warm} |")
        if second:
            line += f" {_f(s.get('warm_ttft_total_s'))} ({_f(s.get('warm_vs_lru'))}) |"
        out.append(line)
    stores = {n: s for n, s in runs.items() if "not_served" in s}
    if stores:
        out += ["", "| run | SSD tokens (MB cold / cached) | tokens not served, by reason | puts skipped / superseded "
                "| blocks skipped | fetch waited us | page cache: drops, cached before -> after / dirty / clean "
                "(means; method) |", "|---|---|---|---|---|---|---|"]
        for name, s in stores.items():
            why = ", ".join(f"{k} {v:,}" for k, v in sorted(s["not_served"].items(), key=lambda kv: -kv[1]))
            mb = " / ".join(_f(s["bytes_by_source"].get(k, 0), "{:.1f}", 1e-6) for k in ("ssd_cold", "ssd_cached"))
            out.append(f"| {name} | {s['ssd_tokens']:,} ({mb}) | {why} | {s.get('puts_skipped', '')} / "
                       f"{s.get('puts_superseded', '')} | {s.get('blocks_skipped', '')} | "
                       f"{s.get('fetch_waited_us', '')} | {_drops(s.get('page_cache_drops'))} |")
    out += [""] if summary.get("engine") else []
    for rnd, e in summary.get("engine", {}).items():
        out.append(f"engine (the none run), {rnd}: {e['steady_tok_per_s']:,.0f} tokens/s steady, a new shape "
                   f"{e['new_shape_s'] * 1e3:.1f} ms a request ({e['from']})")
    return "\n".join(out)


# what each request got, compared run by run between two replays of one trace (a change must not move them)
TOKEN_KEYS = ("session", "prompt_tokens", "cached_tokens", "computed_tokens", "ram_tokens", "ssd_tokens")


def _rounds(folder: Path) -> dict[str, list[list[dict]]]:
    out = {}
    for f in sorted(folder.glob("replay-*.json")):
        d = json.loads(f.read_text())
        rows = [d["rows"]] + ([d["warm_run"]["rows"]] if d.get("warm_run") else [])
        out[f.stem.removeprefix("replay-")] = [[{k: r[k] for k in TOKEN_KEYS if k in r} for r in rs] for rs in rows]
    return out


def compare(a: Path, b: Path) -> int:
    """Print, per run and round both folders hold, whether every request's tokens (``TOKEN_KEYS``) are the
    same; 0 when they all are, 1 otherwise."""
    ra, rb = _rounds(a), _rounds(b)
    differ = 0
    for name in sorted(set(ra) & set(rb)):
        for k, (x, y) in enumerate(zip(ra[name], rb[name])):
            bad = [i for i, (p, q) in enumerate(zip(x, y)) if p != q] + ([len(x)] if len(x) != len(y) else [])
            differ += bool(bad)
            print(f"{name:20s} round {k + 1}: {len(x)} / {len(y)} requests, "
                  + ("identical" if not bad else f"differ at requests {bad[:10]}"))
    for name in sorted(set(ra) ^ set(rb)):
        print(f"{name:20s} in {'the first' if name in ra else 'the second'} folder only")
    print("every request's tokens identical" if not differ else f"{differ} rounds differ")
    return 1 if differ else 0
