"""The summary table (printed by a run) and the suite's section of
``docs/benchmarks.md``, written from the results: every number in it comes from
the results being reported or the run's ``meta`` (the reading notes are in
``notes``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from .common import MiB, splice
from .notes import fmt, ms, ok, reading_notes
from .replay import SYSTEMS
from .settings import TARGETS


def summary_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(what, result, target, met) rows for the headline table."""
    t_ram, t_warm, t_cold = (TARGETS[k] for k in ("restore_ram_vs_memcpy", "restore_ssd_warm_vs_read",
                                                  "restore_ssd_cold_vs_read"))
    rows = []
    p = results.get("restore")
    if p:
        for name, e in p["entries"].items():
            r = e["ratio"]
            rows.append((f"restore {name}: RAM fetch", f"{e['ram']['gbps']:.2f} GB/s = {r['ram_vs_numpy_memcpy']:.2f}x numpy "
                         f"memcpy, {r['ram_vs_mx_array_copy']:.2f}x mx.array copy", f">= {t_ram:g}x memcpy",
                         ok(r["ram_vs_numpy_memcpy"] >= t_ram) + " (numpy) / " + ok(r["ram_vs_mx_array_copy"] >= t_ram)
                         + " (mx)"))
            proto = r.get("ssd_page_cached_numpy_assemble_vs_read")
            rows.append((f"restore {name}: SSD page-cached", f"{e['ssd_page_cached']['gbps']:.2f} GB/s = "
                         f"{r['ssd_page_cached_vs_read']:.2f}x plain read"
                         + (f" (numpy-assemble prototype: {proto:.2f}x)" if proto else ""), f">= {t_warm:g}x",
                         ok(r["ssd_page_cached_vs_read"] >= t_warm)
                         + (f" (prototype: {ok(proto >= t_warm)})" if proto else "")))
            rows.append((f"restore {name}: SSD cold", f"{e['ssd_cold']['gbps']:.2f} GB/s = {r['ssd_cold_vs_read_cold']:.2f}x "
                         f"plain cold read (I/O path with LMDB readahead off: {r['ssd_cold_ra_off_vs_read_cold']:.2f}x, "
                         f"on: {r['ssd_cold_ra_on_vs_read_cold']:.2f}x)", f">= {t_cold:g}x",
                         ok(r["ssd_cold_vs_read_cold"] >= t_cold)))
            if "ram_quantized" in e:
                rows.append((f"restore {name}: handed over Quantized (no dequantize)",
                             f"RAM {r['ram_quantized_vs_numpy_memcpy']:.2f}x memcpy, SSD cached "
                             f"{r['ssd_page_cached_quantized_vs_read']:.2f}x read, SSD cold "
                             f"{r['ssd_cold_quantized_vs_read_cold']:.2f}x; dequantized fetch is "
                             f"{r['dequantized_vs_quantized_time']:.0f}x slower", f"{t_ram:g} / {t_warm:g} / {t_cold:g}",
                             f"{ok(r['ram_quantized_vs_numpy_memcpy'] >= t_ram)} / "
                             f"{ok(r['ssd_page_cached_quantized_vs_read'] >= t_warm)} / "
                             f"{ok(r['ssd_cold_quantized_vs_read_cold'] >= t_cold)}"))
    p = results.get("lookup")
    if p:
        walk = (f"; hashing + walk in an index of {p['blocks_indexed']:,} blocks "
                f"{ms(p['hash_only_np']) + ms(p['walk_only']):.3f} ms")
        rows.append((f"lookup: contains() of {p['prompt_tokens'] // 1024}K tokens",
                     f"{ms(p['contains_np']):.3f} ms (np tokens), {ms(p['contains_list']):.3f} ms (list){walk}",
                     f"< {p['target_ms']:g} ms", ok(p["met"]) + ("" if p["met_list_input"] else " (list input: not met)")))
    p = results.get("put")
    if p:
        rows.append((f"put: blocking, {p['shape']['tokens'] // 1024}K tokens ({p['bytes'] / MiB:,.0f} MiB)",
                     f"{ms(p['blocking_ssd_store']):.3f} ms", f"< {p['target_ms']:g} ms", ok(p["met"])))
        rows.append(("put -> flushed (background to SSD)", f"{p['background_to_ssd']['gbps']:.2f} GB/s = "
                     f"{p['ratio_background_vs_plain_write']:.2f}x plain write+fsync "
                     f"({p['plain_write_fsync']['gbps']:.2f} GB/s, same run)", "-", "-"))
    p = results.get("ttft")
    if p:
        for n, e in p["lengths"].items():
            rows.append((f"ttft {int(n) // 1024}K: kvstore RAM / SSD / LRU hit vs cold",
                         f"{e['speedup_vs_cold']['kvstore_ram']:.0f}x / {e['speedup_vs_cold']['kvstore_ssd']:.0f}x / "
                         f"{e['speedup_vs_cold']['lru_prompt_cache']:.0f}x faster; kvstore RAM = "
                         f"{e['kvstore_ram_vs_lru']:.2f}x LRU's TTFT", "-", "-"))
    p = results.get("replay")
    if p:
        target = p.get("target_recompute_vs_lru", TARGETS["replay_recompute_vs_lru"])
        for b in p.get("budgets", []):
            sy = b["systems"]
            s = sy["kvstore_q8_ssd"]
            rows.append((f"replay, RAM budget {b['budget_frac']:.0%} of the working set: tokens recomputed, "
                         f"kvstore q8+SSD vs LRUPromptCache",
                         f"{s['recompute_vs_lru']:.3f}x ({s['recomputed_tokens']:,} vs {sy['lru']['recomputed_tokens']:,}; "
                         f"fp16 {sy['kvstore_fp16']['recompute_vs_lru']:.2f}x, q8 {sy['kvstore_q8']['recompute_vs_lru']:.2f}x, "
                         f"unbounded cache {p['ideal']['recomputed_tokens']:,}); total TTFT "
                         f"{s['ttft_total_vs_lru']:.2f}x", f"<= {target:.3f}x", ok(b["met"])))
    return rows


# ------------------------------------------------------------------ the page

SECTION = ("<!-- begin suite -->", "<!-- end suite -->")  # the part of docs/benchmarks.md a run rewrites


def _intro(meta: dict) -> list[str]:
    out = ["## The CPU suite: `kvstore bench`\n"]
    text = ("`kvstore bench` (or `python -m kvstore.tools.bench`; `--quick`: small sizes, `--only PART ...`, `--out DIR` "
            "for the JSON and plots): a full run (~10 min) rewrites this section. "
            f"{meta['mode'].capitalize()} run of {meta['date']} ({meta['runtime_s'] / 60:.1f} min of benchmarks) on "
            f"{meta['machine']}; mlx {meta['mlx']} ({meta.get('mlx_speed', {}).get('device', 'cpu').upper()}), "
            f"mlx-lm {meta['mlx_lm']}, Python {meta['python']}.")
    dates = meta.get("part_dates", {})
    if len(set(dates.values())) > 1:
        text += " Parts from different runs: " + ", ".join(f"{p} {d}" for p, d in dates.items()) + "."
    s = meta.get("mlx_speed")
    if s:
        text += (f" Here mlx runs an fp16 add at {s['fp16_add_gbps']:.2f} GB/s (both inputs and the output) and a "
                 f"{s['matmul_size']}x{s['matmul_size']} float32 matmul at {s['matmul_gflops']:.1f} GFLOP/s "
                 f"({s['numpy_matmul_gflops']:.1f} for numpy): model time is far from Apple silicon's, memory and "
                 "disk time less so.")
    out.append(text + " The run prints its targets; the page's summary carries them.\n")
    return out


def _restore_section(p: dict, a) -> None:
    sh = p["shape"]
    llama8b = " (Llama-3-8B's KV shape)" if (sh["layers"], sh["heads"], sh["dim"]) == (32, 8, 128) else ""
    res_pre = [x for e in p["entries"].values() for x in e["ssd_cold"].get("resident_before_fetch", [])]
    a("### restore: fetch GB/s\n")
    a(f"{sh['layers']} layers x {sh['heads']} KV heads x head_dim {sh['dim']} x {sh['tokens']} tokens{llama8b}, "
      f"{p['fp16_bytes'] / MiB:,.0f} MiB fp16, block size {sh['block_size']}; GB/s of stored bytes per `fetch` of the "
      "whole prefix into ready mlx arrays. SSD: a store with `budget_gb=0`; cold: the file dropped from the page "
      f"cache and the store reopened before each fetch (median {np.median(res_pre) if res_pre else float('nan'):.1%} "
      f"of it resident after the open; `read_ahead_kb` {p.get('read_ahead_kb', '?')}). *Q*: quantized entries handed "
      f"over as `Quantized` (bits, {sh.get('group_size', 'group')}), not dequantized; *RA off / on*: the cold fetch "
      "with LMDB's readahead forced off / on. Baselines on the same bytes: numpy and `mx.array` copies, a plain "
      "`readinto` of a file.\n")
    a("| entries | MiB | RAM | RAM Q | SSD cached | SSD cached Q | SSD cold | SSD cold Q | cold RA off / on | "
      "memcpy numpy / mx | plain read cached / cold |")
    a("|---|---|---|---|---|---|---|---|---|---|---|")
    g = lambda e, k: fmt(e.get(k, {}).get("gbps"))  # noqa: E731
    for name, e in p["entries"].items():
        b = e["baselines"]
        a(f"| {name} | {e['stored_bytes'] / MiB:,.0f} | {g(e, 'ram')} | {g(e, 'ram_quantized')} | "
          f"{g(e, 'ssd_page_cached')} | {g(e, 'ssd_page_cached_quantized')} | {g(e, 'ssd_cold')} | "
          f"{g(e, 'ssd_cold_quantized')} | {g(e, 'ssd_cold_ra_off')} / {g(e, 'ssd_cold_ra_on')} | "
          f"{b['numpy_copy']['gbps']:.2f} / {b['mx_array_copy']['gbps']:.2f} | "
          f"{b['read_page_cached']['gbps']:.2f} / {b['read_cold']['gbps']:.2f} |")
    a("")
    a("![restore](bench/restore.png)\n")


def _lookup_section(p: dict, a) -> None:
    chain = p.get("filler_chain_blocks")
    f = p["fetch_full"]
    a("### lookup: index walk + hashing\n")
    a(f"A {p['prompt_tokens']:,}-token prompt ({p['prompt_blocks']} blocks of {p['block_size']}, real KV) in a RAM "
      f"store; the walk is also timed in a `RadixIndex` of {p['blocks_indexed']:,} blocks (the prompt's chain and "
      "filler chains" + (f" of {chain} blocks" if chain else "") + " under one root). Medians: key hashing "
      f"{ms(p['hash_only_np']):.3f} ms (int32 array), the walk {ms(p['walk_only']):.3f} ms, `contains` "
      f"{ms(p['contains_np']):.3f} ms (a Python list: {ms(p['contains_list']):.3f} ms), a miss at the first block "
      f"{ms(p['contains_miss_np']):.3f} ms; `fetch` of the whole prompt ({f['kv_bytes'] / MiB:.0f} MiB KV) "
      f"{ms(f):.1f} ms ({f['gbps']:.2f} GB/s).\n")


def _put_section(p: dict, a) -> None:
    sh = p["shape"]
    q = p["q8"]
    a("### put: the caller's time and the background write\n")
    a(f"{sh['tokens']:,} tokens x {sh['layers']} layers x {sh['heads']} KV heads x head_dim {sh['dim']} "
      f"({p['bytes'] / MiB:,.0f} MiB fp16), block size {sh['block_size']}, RAM + SSD store.\n")
    a("| `put` blocking: RAM + SSD store / RAM only / an already stored prefix / a model's first in a store | "
      "put -> flushed (encode + write) | plain write + fsync, same bytes | 8-bit entries: blocking / flushed |")
    a("|---|---|---|---|")
    a(f"| {ms(p['blocking_ssd_store']):.3f} / {ms(p['blocking_ram_store']):.3f} / "
      f"{ms(p['blocking_already_stored']):.3f} / {ms(p['blocking_first_put_of_model']):.3f} ms | "
      f"{p['background_to_ssd']['median_s']:.2f} s = {p['background_to_ssd']['gbps']:.2f} GB/s "
      f"({p['ratio_background_vs_plain_write']:.2f}x) | {p['plain_write_fsync']['gbps']:.2f} GB/s | "
      f"{ms(q['blocking']):.3f} ms / {q['background_to_ssd']['gbps']:.2f} GB/s of fp16 input ({q['tokens']:,} tokens) |")
    a("")


def _ttft_section(p: dict, a) -> None:
    a("### ttft: time to first token\n")
    a(f"{p['model']}. Cold: `mlx_lm.stream_generate`; kvstore: `kvstore.adapters.generate.generate`; SSD: the store "
      "reopened before each request (cold: its pages dropped too); LRU: mlx-lm's `LRUPromptCache` "
      "(`fetch_nearest_cache`, then the rest). Every hit serves all but the last prompt token.\n")
    a("| prompt tokens | cold | kvstore RAM | kvstore SSD | kvstore SSD cold | LRUPromptCache | RAM speed-up | kvstore RAM / LRU |")
    a("|---|---|---|---|---|---|---|---|")
    for n, e in p["lengths"].items():
        a(f"| {int(n):,} | {ms(e['cold']):,.0f} ms | {ms(e['kvstore_ram']):.1f} ms | "
          f"{ms(e['kvstore_ssd']):.1f} ms | {ms(e['kvstore_ssd_cold']):.1f} ms | "
          f"{ms(e['lru_prompt_cache']):.1f} ms | {e['speedup_vs_cold']['kvstore_ram']:.0f}x | "
          f"{e['kvstore_ram_vs_lru']:.2f} |")
    a("")
    a("![ttft](bench/ttft.png)\n")


def _replay_section(p: dict, a) -> None:
    t = p["trace"]
    a("### replay: many users, one RAM budget\n")
    a(f"A seeded trace (`make_trace`, tools/bench/replay.py): {p['sessions']} sessions ({p['chat_sessions']} chats, "
      f"{p['agent_sessions']} agent loops) on system prompts of {', '.join(map(str, t['sys_lens']))} tokens, "
      f"{t['concurrency']} active at a time, interleaved; {p['requests']} requests, {p['prompt_tokens']:,} prompt "
      f"tokens, {p['unique_tokens']:,} distinct = {p['working_set_fp16_bytes'] / MiB:.1f} MiB of fp16 KV. Each "
      f"request runs the {p.get('model', 'tiny llama')} (look up, restore, prefill the rest, first token, then the "
      "trace's response teacher-forced and the cache stored); every system gets the same RAM byte budget.\n")
    a("| RAM budget | system | tokens recomputed | vs LRU | token hit rate | TTFT total | p50 | p95 |")
    a("|---|---|---|---|---|---|---|---|")
    for b in p["budgets"]:
        for name, _ in SYSTEMS:
            s = b["systems"][name]
            a(f"| {b['ram_budget_bytes'] / MiB:.2f} MiB ({b['budget_frac']:.0%}) | {s['label']} | "
              f"{s['recomputed_tokens']:,} | {s['recompute_vs_lru']:.3f} | {s['token_hit_rate']:.1%} | "
              f"{s['ttft_total_s']:.1f} s | {s['ttft_p50_s'] * 1e3:.0f} ms | {s['ttft_p95_s'] * 1e3:.0f} ms |")
    a(f"| unbounded | (any exact prefix cache) | {p['ideal']['recomputed_tokens']:,} | "
      f"{p['ideal']['recomputed_tokens'] / max(1, p['systems']['lru']['recomputed_tokens']):.3f} | "
      f"{p['ideal']['token_hit_rate']:.1%} | | | |")
    a("")
    a("![replay](bench/replay.png)\n")


def _fidelity_section(p: dict, a) -> None:
    kinds = list(p["models"])
    codecs = list(dict.fromkeys(c for rows in p["models"].values() for c in rows))
    a("### fidelity: quantized entries against a cold prefill\n")
    a(f"{p['prompts']} prompts of {p['prompt_len']} tokens per model; the first {p['stored_prefix']} stored, "
      "fetched back and the rest run on the restored cache, against one cold prefill. Cells: mean KL(cold || "
      f"restored) of the last token's logits, top-1 agreement, identical prefix of {p['greedy_tokens']} greedy tokens "
      "(the fp16 row is the noise floor: the stored prefix was prefilled in other chunks).\n")
    a("| entries | " + " | ".join(kinds) + " |")
    a("|---|" + "---|" * len(kinds))
    for c in codecs:
        cells = []
        for k in kinds:
            r = p["models"][k].get(c)
            cells.append(f"{r['kl_mean']:.2e}, {r['top1_agree']:.0%}, {r['greedy_identical_prefix']:.0%}" if r else "-")
        a(f"| {c} | " + " | ".join(cells) + " |")
    a("")


SECTIONS = {"restore": _restore_section, "lookup": _lookup_section, "put": _put_section, "ttft": _ttft_section,
            "replay": _replay_section, "fidelity": _fidelity_section}


def write_docs(results: dict, meta: dict, out: Path, docs: Path) -> Path:
    """The suite's section of ``docs/benchmarks.md`` (between ``SECTION``'s markers; the rest of the page is
    kept, and a page without them gets the section at its end), from the results, with the plots copied to
    ``docs/bench/``."""
    docs.mkdir(parents=True, exist_ok=True)
    img = docs / "bench"
    img.mkdir(exist_ok=True)
    for png in out.glob("*.png"):
        shutil.copy(png, img / png.name)
    L: list[str] = [SECTION[0]]
    a = L.append
    L += _intro(meta)
    for n in reading_notes(results):
        a(f"- {n}")
    a("")
    for part, section in SECTIONS.items():
        if results.get(part):
            section(results[part], a)
    a(SECTION[1])
    path = docs / "benchmarks.md"
    splice(path, SECTION, "\n".join(L))
    return path
