"""The live replay's runs side by side (issue 42): each run's figures (and its second round's, under
``--warm``), its ratios to LRU and fp16 of the same budget and to its floor, the issue's checks, and the
table ``live_replay.py`` prints.

The floor of a round: its computed tokens at the ``none`` run's prefill rate in the same round (prompt
tokens over TTFT) + the bytes its hits served (``Hit.source_bytes``) at ``bus_gbps``, the fastest of an
``mx.array(numpy)`` copy, a pinned copy on CUDA and the store's own measured RAM fetch rate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

SYSTEMS = ("none", "lru", "kvstore_fp16", "kvstore_q8")
# the "must hold" (H200, 8B shape): kvstore fp16 / LRU per budget, and the rest
TARGETS = {"fp16_vs_lru": {0.25: 0.6, 0.1: 0.5}, "fp16_vs_floor": 1.25, "q8_vs_fp16": 1.1, "fresh_vs_warm": 1.1,
           "vs_cold": 1.1, "put_p99_s": 2e-3, "put_max_s": 10e-3, "serve_vs_mlx_lm": 0.5}
# one replay's own figures (a run's first round, or its warm_run)
ROUND_KEYS = ("ttft_total_s", "ttft_p50_s", "ttft_p95_s", "ttft_max_s", "tokens_computed", "bytes_served",
              "fetch_total_s", "prefill_total_s", "put_p50_s", "put_p99_s", "put_max_s", "gc_full_s", "wall_s",
              "open_s", "calibrate_s", "flush_s")
# the store's counters that say where a round's time went (the writer, the fetches that waited for it, pinning)
STAT_KEYS = ("puts_skipped", "blocks_skipped", "evictions_ram", "writer_us", "fetch_waited_us", "pinned_made_bytes",
             "pinned_made_s", "pageable_past_cap_bytes")


def run_name(system: str, frac: float) -> str:
    return "none" if system == "none" else f"{system}-{frac:g}"


def _rate(none: Optional[dict]) -> Optional[float]:
    return none["prompt_tokens"] / none["ttft_total_s"] if none else None


def _round(r: dict, none: Optional[dict], bus: list[Optional[float]]) -> dict:
    """One replay's figures, each request against the cold one (``none``'s replay of the same round),
    and its floor (``bus``: the process's measured copy rates)."""
    s: dict[str, Any] = {k: r.get(k) for k in ROUND_KEYS}
    if none:
        ratios = [x["ttft_s"] / c["ttft_s"] for x, c in zip(r["rows"], none["rows"])]
        s["vs_cold_max"], s["vs_cold_over_1_1"] = max(ratios), sum(x > TARGETS["vs_cold"] for x in ratios)
    stats = r.get("store_stats")
    if stats:
        s.update({k: stats[k] for k in STAT_KEYS if k in stats})
        s["not_served"] = {k: v for k, v in stats.get("tokens_not_served", {}).items() if v}
        # every request: the tokens served plus those not served, by reason, are its prompt's
        s["reasons_add_up"] = all(x["cached_tokens"] + sum(x.get("not_served", {}).values()) == x["prompt_tokens"]
                                  for x in r["rows"])
        ram = stats["cost"]["rates"].get("ram", {})
        s["store_ram_gbps"] = ram.get("gb_per_s") if ram.get("observed") else None
        s["bus_gbps"] = max(x for x in (*bus, s["store_ram_gbps"]) if x)
        if none:
            s["floor_s"] = r["tokens_computed"] / _rate(none) + r["bytes_served"] / (s["bus_gbps"] * 1e9)
            s["vs_floor"] = r["ttft_total_s"] / s["floor_s"]
    return s


def _ratios(runs: dict[str, dict], prefix: str) -> None:
    """vs LRU and q8 vs fp16 of the same budget, for the round whose keys start with ``prefix``."""
    total = prefix + "ttft_total_s"
    for s in runs.values():
        lru = runs.get(run_name("lru", s["budget_frac"]))
        if lru and lru.get(total) and s["system"] not in ("lru", "none") and s.get(total):
            s[prefix + "vs_lru"] = s[total] / lru[total]
        fp16 = runs.get(run_name("kvstore_fp16", s["budget_frac"]))
        if fp16 and fp16.get(total) and s["system"] == "kvstore_q8" and s.get(total):
            s[prefix + "vs_fp16"] = s[total] / fp16[total]


def summarize(runs: dict[str, dict]) -> dict:
    """Ratios, floors and the issue's checks from the runs' JSON (keyed by ``run_name``); a run's second
    round (``warm_run``) has the same figures under ``warm_`` keys."""
    none = runs.get("none")
    none_warm = none.get("warm_run") if none else None
    out: dict[str, Any] = {"prefill_tok_per_s_none": _rate(none), "prefill_tok_per_s_none_warm": _rate(none_warm),
                           "runs": {}, "checks": {}}
    for name, r in runs.items():
        bus = [r.get("copy_gbps"), r.get("pinned_gbps")]
        s = {"system": r["system"], "budget_frac": r["budget_frac"], "load_s": r.get("load_s"),
             "copy_gbps": bus[0], "pinned_gbps": bus[1], **_round(r, none, bus)}
        if r.get("warm_run"):
            s.update({f"warm_{k}": v for k, v in _round(r["warm_run"], none_warm, bus).items()})
            s["fresh_vs_warm"] = r["ttft_total_s"] / s["warm_ttft_total_s"]
        out["runs"][name] = s
    _ratios(out["runs"], "")
    _ratios(out["runs"], "warm_")
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
            want = TARGETS["fresh_vs_warm"]
            checks[f"{name} fresh vs warm <= {want}"] = s["fresh_vs_warm"] <= want
        if "vs_cold_max" in s:
            checks[f"{name} no request over {TARGETS['vs_cold']}x cold"] = s["vs_cold_over_1_1"] == 0
        if "reasons_add_up" in s:
            checks[f"{name} served + not served = prompt, every request"] = s["reasons_add_up"]
        checks[f"{name} put p99 <= 2 ms, max <= 10 ms"] = (s["put_p99_s"] <= TARGETS["put_p99_s"]
                                                          and s["put_max_s"] <= TARGETS["put_max_s"])
    return out


def table(summary: dict) -> str:
    """The summary as a markdown table, one row per run."""
    def f(x, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
        return "" if x is None else fmt.format(x * scale)

    def paired(x, y, unit: str = "") -> str:  # "x (y)"
        return f(x) + ("" if y is None else f" ({y:.2f}{unit})")

    lines = ["| cache | B | total TTFT s | p50 / p95 / max ms | tokens computed | fetch s (round 2) "
             "| put p50 / p99 / max ms | vs LRU | floor s (x) | round 2 s (vs LRU) | max vs cold |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["runs"].values():
        ttft = " / ".join(f(s[k], "{:.0f}", 1e3) for k in ("ttft_p50_s", "ttft_p95_s", "ttft_max_s"))
        put = " / ".join(f(s[k], "{:.2f}", 1e3) for k in ("put_p50_s", "put_p99_s", "put_max_s"))
        floor = paired(s.get("floor_s"), s.get("vs_floor"), "x")
        fetch = paired(s["fetch_total_s"], s.get("warm_fetch_total_s"))
        warm = paired(s.get("warm_ttft_total_s"), s.get("warm_vs_lru"))
        lines.append(f"| {s['system']} | {f(s['budget_frac'] or None, '{:.0%}')} | {s['ttft_total_s']:.2f} | {ttft} "
                     f"| {s['tokens_computed']:,} | {fetch} | {put} | {f(s.get('vs_lru'))} | {floor} "
                     f"| {warm} | {f(s.get('vs_cold_max'))} |")
    return "\n".join(lines)


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
