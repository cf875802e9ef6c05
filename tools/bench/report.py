"""The summary table and ``docs/benchmarks.md``, written from the results:
every number on the page comes from the results being reported or the run's
``meta`` (the reading notes are in ``notes``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np

from .common import MiB
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


def _intro(meta: dict) -> list[str]:
    out = [f"Generated by `python -m kvstore.tools.bench` ({meta['mode']} run, {meta['date']}, "
           f"{meta['runtime_s'] / 60:.1f} min of benchmarks). Machine: {meta['machine']}; "
           f"mlx {meta['mlx']} ({meta.get('mlx_speed', {}).get('device', 'cpu').upper()}), mlx-lm {meta['mlx_lm']}, Python {meta['python']}.\n"]
    dates = meta.get("part_dates", {})
    if len(set(dates.values())) > 1:
        out.append("Parts come from different runs: " + ", ".join(f"{p} {d}" for p, d in dates.items()) + ".\n")
    text = "Every figure is the median over repeats; every baseline was measured in the same run, so read the ratios."
    s = meta.get("mlx_speed")
    if s:
        text += (f" Absolute numbers depend on the machine: here mlx runs an fp16 add at "
                 f"{s['fp16_add_gbps']:.2f} GB/s (both inputs and the output) and a {s['matmul_size']}x"
                 f"{s['matmul_size']} float32 matmul at {s['matmul_gflops']:.1f} GFLOP/s vs "
                 f"{s['numpy_matmul_gflops']:.1f} for numpy: model time here is far from Apple silicon, memory and "
                 "disk time less so.")
    out.append(text + "\n")
    return out


def _restore_section(p: dict, a) -> None:
    sh = p["shape"]
    llama8b = " (Llama-3-8B's KV shape)" if (sh["layers"], sh["heads"], sh["dim"]) == (32, 8, 128) else ""
    a("## restore: fetch throughput\n")
    a(f"Layer set{llama8b}: {sh['layers']} layers x {sh['heads']} KV heads x head_dim {sh['dim']} x "
      f"{sh['tokens']} tokens ({p['fp16_bytes'] / MiB:,.0f} MiB fp16), block size {sh['block_size']}. GB/s are of "
      "*stored* bytes (what the tier holds), per `fetch` of the whole prefix into ready mlx arrays. SSD: a store "
      "opened with `budget_gb=0` so nothing is promoted to RAM; cold = the LMDB file's pages dropped with "
      "`posix_fadvise(DONTNEED)` and the store reopened before each fetch. Baselines on the same byte count: "
      "numpy copy (alloc + memcpy), `mx.array(numpy)` copy, a plain `readinto` of a file of the same size "
      "(page-cached and cold).\n")
    res_pre = [x for e in p["entries"].values() for x in e["ssd_cold"].get("resident_before_fetch", [])]
    a(f"kvstore opened LMDB with `readahead={p.get('lmdb_readahead')}` in this run (`read_ahead_kb` = "
      f"{p.get('read_ahead_kb', '?')} here). Opening the store reads its index, its own pages only (no read-around "
      f"since 40f3494): median {np.median(res_pre) if res_pre else float('nan'):.1%} of data.mdb was resident "
      "before the timed cold fetch (recorded per repeat in restore.json).\n")
    a(f"Fetch, GB/s (entries as stored; *Quantized* = `quantized=(bits, {sh.get('group_size', 'group')})`, handed "
      "over without dequantizing; "
      "*I/O path* = the same cold fetch (Quantized for quantized entries) with LMDB's readahead forced off / on):\n")
    a("| entries | stored MiB | RAM | RAM Quantized | SSD cached | SSD cached Quantized | SSD cold | "
      "SSD cold Quantized | I/O path cold, RA off | I/O path cold, RA on |")
    a("|---|---|---|---|---|---|---|---|---|---|")
    g = lambda e, k: fmt(e.get(k, {}).get("gbps"))  # noqa: E731
    for name, e in p["entries"].items():
        a(f"| {name} | {e['stored_bytes'] / MiB:,.0f} | {g(e, 'ram')} | {g(e, 'ram_quantized')} | "
          f"{g(e, 'ssd_page_cached')} | {g(e, 'ssd_page_cached_quantized')} | {g(e, 'ssd_cold')} | "
          f"{g(e, 'ssd_cold_quantized')} | {g(e, 'ssd_cold_ra_off')} | {g(e, 'ssd_cold_ra_on')} |")
    a("")
    a("Baselines on the same byte counts, GB/s:\n")
    a("| entries | numpy memcpy | mx.array copy | plain read, page-cached | plain read, cold |")
    a("|---|---|---|---|---|")
    for name, e in p["entries"].items():
        b = e["baselines"]
        a(f"| {name} | {b['numpy_copy']['gbps']:.2f} | {b['mx_array_copy']['gbps']:.2f} | "
          f"{b['read_page_cached']['gbps']:.2f} | {b['read_cold']['gbps']:.2f} |")
    a("")
    a("Ratios (same bytes):\n")
    a("| entries | RAM / numpy memcpy | RAM / mx.array copy | RAM Quantized / numpy memcpy | SSD cached / read | "
      "SSD cached Quantized / read | SSD cold / cold read | SSD cold Quantized / cold read | "
      "I/O path RA off / cold read | I/O path RA on / cold read | dequantized / Quantized fetch time | "
      "dequantize share of RAM fetch |")
    a("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, e in p["entries"].items():
        r = e["ratio"]
        a(f"| {name} | {r['ram_vs_numpy_memcpy']:.2f} | {r['ram_vs_mx_array_copy']:.2f} | "
          f"{fmt(r.get('ram_quantized_vs_numpy_memcpy'))} | {r['ssd_page_cached_vs_read']:.2f} | "
          f"{fmt(r.get('ssd_page_cached_quantized_vs_read'))} | {r['ssd_cold_vs_read_cold']:.2f} | "
          f"{fmt(r.get('ssd_cold_quantized_vs_read_cold'))} | {r['ssd_cold_ra_off_vs_read_cold']:.2f} | "
          f"{r['ssd_cold_ra_on_vs_read_cold']:.2f} | "
          f"{fmt(r.get('dequantized_vs_quantized_time'))} | {fmt(e.get('dequant_share_of_ram_fetch'))} |")
    a("")
    e = p["entries"].get("fp16", {})
    if "ssd_page_cached_numpy_assemble" in e:
        a(f"Prototype (fp16, page-cached): assembling each layer with numpy straight from the LMDB mmap views and "
          f"copying once into mlx takes {ms(e['ssd_page_cached_numpy_assemble']):.0f} ms vs "
          f"{ms(e['ssd_page_cached']):.0f} ms for `fetch` "
          f"({e['ssd_page_cached']['median_s'] / e['ssd_page_cached_numpy_assemble']['median_s']:.1f}x faster, "
          f"{e['ratio']['ssd_page_cached_numpy_assemble_vs_read']:.2f}x plain read).\n")
    dq = [(n, e["dequant_paths"]) for n, e in p["entries"].items() if e.get("dequant_paths")]
    if dq:
        a("Dequantize paths for the whole fetched set (GB/s of fp16 output; speed-up vs kvstore's "
          "`Quantized.dequantize` on one core; max |diff| vs `mx.dequantize`; `fetch` runs the second row):\n")
        a("| entries | path | GB/s out | speed-up | max abs diff |")
        a("|---|---|---|---|---|")
        for n, d in dq:
            for path, v in d.items():
                a(f"| {n} | {path} | {v['gbps']:.2f} | {v['speedup_vs_shipped']:.2f}x | "
                  f"{v['max_abs_diff_vs_mx_dequantize']:.2g} |")
        a("")
    a("![restore](bench/restore.png)\n")


def _lookup_section(p: dict, a) -> None:
    a("## lookup: index walk + hashing\n")
    chain = p.get("filler_chain_blocks")
    a(f"A {p['prompt_tokens']:,}-token prompt ({p['prompt_blocks']} blocks of {p['block_size']}, real KV) in a RAM "
      f"store, whose index then holds the prompt's blocks. The walk is also timed in a `kvstore.state.index.RadixIndex` of "
      f"{p['blocks_indexed']:,} blocks: the prompt's chain plus filler chains"
      + (f" of {chain} blocks" if chain else "") + " under the same root.\n")
    turn = p.get("next_turn_new_tokens")
    a("| measurement | median |")
    a("|---|---|")
    for k, label in (("hash_only_np", "key hashing only (int32 array)"), ("as_tokens_list", "`as_tokens` of a Python list"),
                     ("hash_only_list", "key hashing from a Python list"),
                     ("walk_only", f"index walk only (keys precomputed), {p['blocks_indexed']:,} blocks"),
                     ("walk_only_prompt_index", f"index walk only, {p['prompt_blocks']} blocks (the prompt's)"),
                     ("contains_np", "`contains` (walk + hashing), int32 array"), ("contains_list", "`contains`, Python list"),
                     ("contains_partial_np", "`contains`, prompt diverging inside the last block"),
                     ("contains_next_turn_np", f"`contains`, stored prompt + {turn or 'some'} new tokens"),
                     ("contains_miss_np", "`contains`, miss at the first block")):
        if k in p:
            a(f"| {label} | {ms(p[k]):.3f} ms |")
    f = p["fetch_full"]
    a(f"| `fetch` of the whole prompt ({f['kv_bytes'] / MiB:.0f} MiB KV) | {ms(f):.1f} ms ({f['gbps']:.2f} GB/s) |")
    a("")


def _put_section(p: dict, a) -> None:
    sh = p["shape"]
    a("## put: caller blocking time and background throughput\n")
    a(f"{sh['tokens']:,} tokens x {sh['layers']} layers x {sh['heads']} KV heads x head_dim {sh['dim']} "
      f"({p['bytes'] / MiB:,.0f} MiB fp16), block size {sh['block_size']}, RAM + SSD store.\n")
    q = p["q8"]
    a("| measurement | median |")
    a("|---|---|")
    a(f"| `put` blocking (RAM + SSD store) | {ms(p['blocking_ssd_store']):.3f} ms |")
    a(f"| `put` blocking (RAM-only store) | {ms(p['blocking_ram_store']):.3f} ms |")
    a(f"| `put` of an already stored prefix | {ms(p['blocking_already_stored']):.3f} ms |")
    a(f"| first `put` of a model key in a store (registers it in LMDB, {sh['block_size']} tokens) | "
      f"{ms(p['blocking_first_put_of_model']):.3f} ms |")
    a(f"| put -> flushed (encode + write to LMDB) | {p['background_to_ssd']['median_s']:.2f} s = "
      f"{p['background_to_ssd']['gbps']:.2f} GB/s |")
    a(f"| plain file write + fsync, same bytes, same repeats | {p['plain_write_fsync']['gbps']:.2f} GB/s "
      f"(put -> flushed = {p['ratio_background_vs_plain_write']:.2f}x) |")
    a(f"| 8-bit entries, {q['tokens']:,} tokens: blocking | {ms(q['blocking']):.3f} ms |")
    a(f"| 8-bit entries: put -> flush (quantize + write) | {q['background_to_ssd']['gbps']:.2f} GB/s of fp16 input |")
    a("")


def _ttft_section(p: dict, a) -> None:
    a("## ttft: time to first token\n")
    a(f"{p['model']}. Cold = plain `mlx_lm.stream_generate`; kvstore = `kvstore.adapters.generate.generate` "
      "(fetch + rebuild cache + last token); SSD = store closed and reopened before each request (cold: "
      "LMDB pages dropped too); LRU = `LRUPromptCache.fetch_nearest_cache` (deep copy + trim) + "
      "`stream_generate` of the rest. Every hit serves all but the last prompt token.\n")
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
    budgets_mib = ", ".join(f"{b['ram_budget_bytes'] / MiB:.2f} MiB" for b in p["budgets"])
    budgets_pct = ", ".join(f"{b['budget_frac']:.0%}" for b in p["budgets"])
    a("## replay: many users, one RAM budget (headline)\n")
    a(f"Seeded trace: {p['sessions']} sessions ({p['chat_sessions']} chats, {p['agent_sessions']} agent loops) on "
      f"{len(t['sys_lens'])} shared system prompts of {', '.join(map(str, t['sys_lens']))} tokens, "
      f"{t['concurrency']} sessions active at a time and interleaved at random; chat turns add a user message "
      f"({t['user'][0]}-{t['user'][1]} tokens) and a response ({t['resp'][0]}-{t['resp'][1]}); agent steps add a "
      f"tool output ({t['tool'][0]}-{t['tool'][1]}) and an action ({t['action'][0]}-{t['action'][1]}). "
      f"{p['requests']} requests, {p['prompt_tokens']:,} prompt tokens, {p['unique_tokens']:,} distinct tokens = "
      f"{p['working_set_fp16_bytes'] / MiB:.1f} MiB of fp16 KV. Every system gets the same RAM byte budget: "
      f"{budgets_mib} ({budgets_pct} of the working set; the first is the headline).\n")
    a(f"Each request really runs the {p.get('model', 'tiny llama')}: look up, restore, prefill the rest, first token "
      "(TTFT), then the trace's response is fed (teacher-forced) and the cache of prompt + response goes back "
      "(`insert_cache`, as mlx-lm's server does, or `put`).\n")
    a("| RAM budget | system | tokens recomputed | vs LRU | token hit rate | TTFT total | p50 | p95 | "
      "resident RAM max |")
    a("|---|---|---|---|---|---|---|---|---|")
    for b in p["budgets"]:
        for name, _ in SYSTEMS:
            s = b["systems"][name]
            a(f"| {b['ram_budget_bytes'] / MiB:.2f} MiB ({b['budget_frac']:.0%}) | {s['label']} | "
              f"{s['recomputed_tokens']:,} | {s['recompute_vs_lru']:.3f} | {s['token_hit_rate']:.1%} | "
              f"{s['ttft_total_s']:.1f} s | {s['ttft_p50_s'] * 1e3:.0f} ms | {s['ttft_p95_s'] * 1e3:.0f} ms | "
              f"{s['resident_ram_bytes_max'] / MiB:.2f} MiB |")
    a(f"| unbounded | (any exact prefix cache) | {p['ideal']['recomputed_tokens']:,} | "
      f"{p['ideal']['recomputed_tokens'] / max(1, p['systems']['lru']['recomputed_tokens']):.3f} | "
      f"{p['ideal']['token_hit_rate']:.1%} | | | | |")
    a("")
    a("![replay](bench/replay.png)\n")


def _fidelity_section(p: dict, a) -> None:
    a("## fidelity: quantized entries vs a cold prefill\n")
    a(f"{p['prompts']} prompts of {p['prompt_len']} tokens per model; the first {p['stored_prefix']} tokens are "
      "prefilled and stored with the codec, fetched back (dequantized to fp16), the rest of the prompt runs on the "
      f"restored cache. Compared with one cold prefill: last-token logits (max |error|, KL(cold || restored)), "
      f"top-1 agreement, and {p['greedy_tokens']} greedy tokens (identical prefix fraction). The fp16 row is the "
      "noise floor (the stored prefix was prefilled in other chunks than the cold run).\n")
    a("| model | entries | max abs logit err | mean KL | max KL | top-1 agree | greedy identical |")
    a("|---|---|---|---|---|---|---|")
    for kind, rows in p["models"].items():
        for cname, r in rows.items():
            a(f"| {kind} | {cname} | {r['max_abs_logit_err']:.4f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
              f"{r['top1_agree']:.0%} | {r['greedy_identical_prefix']:.0%} |")
    a("")


SECTIONS = {"restore": _restore_section, "lookup": _lookup_section, "put": _put_section, "ttft": _ttft_section,
            "replay": _replay_section, "fidelity": _fidelity_section}


def write_docs(results: dict, meta: dict, out: Path, docs: Path) -> Path:
    """``docs/benchmarks.md`` from the results, with the plots copied to ``docs/bench/``."""
    docs.mkdir(parents=True, exist_ok=True)
    img = docs / "bench"
    img.mkdir(exist_ok=True)
    for png in out.glob("*.png"):
        shutil.copy(png, img / png.name)
    L: list[str] = []
    a = L.append
    a("# Benchmarks\n")
    L += _intro(meta)
    a("## Summary\n")
    a("| what | result | target | |")
    a("|---|---|---|---|")
    for r in summary_rows(results):
        a("| " + " | ".join(r) + " |")
    a("")
    notes = reading_notes(results)
    if notes:
        a("## Reading the results\n")
        for n in notes:
            a(f"- {n}")
        a("")
    for part, section in SECTIONS.items():
        if results.get(part):
            section(results[part], a)
    a("## Reproduce\n")
    a("```\npython -m kvstore.tools.bench            # full run, rewrites this page\n"
      "python -m kvstore.tools.bench --quick    # small sizes, JSON + PNG in bench-out/\n"
      "kvstore bench --only replay --out /tmp/b # the same options through the console script\n```\n")
    path = docs / "benchmarks.md"
    path.write_text("\n".join(L) + _kept_sections(path))
    return path


def _kept_sections(path: Path) -> str:
    """Sections other tools write (``<!-- begin NAME -->`` .. ``<!-- end NAME -->``,
    e.g. tools/remote_bench.py), carried over when this page is rewritten."""
    text = path.read_text() if path.exists() else ""
    return "".join(f"\n{m.group(0)}\n" for m in re.finditer(r"<!-- begin (\S+) -->.*?<!-- end \1 -->", text, re.S))
