"""The "Reading the results" paragraphs: what limits each figure, with every
number taken from the results, and the number formatting the docs page shares.
Wording that depends on a figure (met / not met, faster / slower) is chosen
from the figure."""

from __future__ import annotations

from typing import Optional

from .common import MiB
from .restore import COMPILED, MX_KERNEL, SHIPPED
from .settings import TARGETS


def fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x != x:
            return "-"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def ok(b: bool) -> str:
    return "**met**" if b else "**not met**"


def span(values, f: str = "{:.2f}") -> str:
    """``lo-hi`` of some figures (one figure when they agree as written)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = f.format(min(values)), f.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def ms(d: dict) -> float:
    return d["median_s"] * 1e3


def mib(n: float) -> str:
    return f"{n / MiB:,.0f}" if n >= 10 * MiB else f"{n / MiB:.1f}"


def _note_ram(p: dict) -> Optional[str]:
    fp = p["entries"].get("fp16")
    if not fp or "page_size" not in p:
        return None
    b, page = fp["baselines"], p["page_size"]
    thp = p.get("transparent_hugepage")
    return ("**RAM fetch is bounded by page faults on fresh mlx buffers, spread over the cores.** A fetch writes "
            "the prefix into new mlx buffers. On Linux, glibc serves large buffers with fresh `mmap`s and mlx's CPU "
            "allocator asks for no transparent huge pages"
            + (f" (THP is `{thp}` here)" if thp else "")
            + f", so each {page // 1024} KiB page faults on first write: a {mib(fp['stored_bytes'])} MiB "
            f"`mx.array` copy takes {fp['stored_bytes'] // page:,} minor faults and runs at "
            f"{b['mx_array_copy']['gbps']:.2f} GB/s, numpy's copy (which madvises huge pages) at "
            f"{b['numpy_copy']['gbps']:.2f} GB/s. `fetch` makes the arrays and copies the blocks into them on every "
            "core (`kvstore/convert/spread.py`), which puts fp16 "
            f"fetch at {fp['ratio']['ram_vs_mx_array_copy']:.2f}x one `mx.array` copy of the same bytes.")


def _note_ssd_cached(p: dict) -> Optional[str]:
    fp = p["entries"].get("fp16", {})
    if "ssd_page_cached_numpy_assemble" not in fp:
        return None
    proto = fp["ssd_page_cached"]["median_s"] / fp["ssd_page_cached_numpy_assemble"]["median_s"]
    return ("**SSD page-cached fetch copies each stored byte once**: blocks are read straight from LMDB's mapped "
            "pages into the final per-layer arrays, blocks side by side on every core, each block's checksum taken "
            "as its arrays are copied (`kvstore/convert/gather.py`). The numpy-assemble prototype it grew from (timed in "
            f"the same run) runs at {proto:.2f}x of `fetch`'s speed.")


def _note_ssd_cold(p: dict) -> Optional[str]:
    fp = p["entries"].get("fp16")
    if not fp or "page_size" not in p:
        return None
    sh = p["shape"]
    block = fp["stored_bytes"] / (sh["tokens"] / sh["block_size"])
    cold = fp["baselines"]["read_cold"]
    reads = [fp["stored_bytes"] / t / 1e9 for t in cold["times_s"] if t > 0]
    ra = p.get("read_ahead_kb")
    return (f"**Cold SSD reads depend on LMDB readahead.** With `readahead=False` every {p['page_size'] // 1024} KiB "
            f"page of a {block / MiB:.2f} MiB block is a separate synchronous read (fp16 entries: "
            f"{fp['ssd_cold_ra_off']['gbps']:.2f} GB/s here); with readahead on, the kernel reads ahead"
            + (f" ({ra / 1024:g} MiB here)" if ra else "")
            + f" and the same fetch runs at {fp['ssd_cold_ra_on']['gbps']:.2f} GB/s. 'Cold' is cold in the guest "
            "only: a VM's host may "
            f"cache the disk, so plain cold reads vary (this run's repeats: {span(reads)} GB/s).")


def _note_dequantize(p: dict) -> Optional[str]:
    ents = p["entries"]
    shares = [e["dequant_share_of_ram_fetch"] for e in ents.values() if "dequant_share_of_ram_fetch" in e]
    if not shares:
        return None
    speed = [e["ratio"]["dequantized_vs_quantized_time"] for e in ents.values()
             if "dequantized_vs_quantized_time" in e["ratio"]]
    qmet = [k for k, e in ents.items()
            if e["ratio"].get("ram_quantized_vs_numpy_memcpy", 0) >= TARGETS["restore_ram_vs_memcpy"]]
    text = ("**Serving quantized entries to a dense engine is dequantize-bound on a CPU** "
            f"({span(shares, '{:.0%}')} of the RAM fetch): handed over as `Quantized` (an engine running `kv_bits` / "
            f"`QuantizedKVCache` needs no dequantize) the same fetch is {span(speed, '{:.0f}')}x faster"
            + (f" and meets the RAM target for {', '.join(qmet)}." if qmet else "."))
    paths = [e["dequant_paths"] for e in ents.values() if e.get("dequant_paths")]
    if not paths or not all(SHIPPED in d and MX_KERNEL in d for d in paths):
        return text
    exact = all(d[SHIPPED]["max_abs_diff_vs_mx_dequantize"] == 0 for d in paths)
    vs_kernel = [1 / d[MX_KERNEL]["speedup_vs_shipped"] for d in paths]
    text += (f" kvstore's dequantize is {'bit-exact with' if exact else 'not bit-exact with'} `mx.dequantize` and "
             f"{span(vs_kernel, '{:.1f}')}x as fast on one core (byte unpacking, fp32 math rounded where mlx's half "
             "kernel rounds); `fetch` runs it on every core.")
    numpy = [v for d in paths for k, v in d.items() if k.startswith("numpy")]
    if numpy:
        text += (f" Numpy paths in fp32 run {span([v['speedup_vs_shipped'] for v in numpy])}x as fast as it and differ "
                 f"from `mx.dequantize` by up to {max(v['max_abs_diff_vs_mx_dequantize'] for v in numpy):.2g}.")
    if all(COMPILED in d for d in paths):
        comp = [d[COMPILED]["gbps"] for d in paths]
        ship = [d[SHIPPED]["gbps"] for d in paths]
        verdict = "faster" if min(comp) > max(ship) else "slower" if max(comp) < min(ship) else "the ranges overlap"
        text += f" `mx.compile` of the same function runs at {span(comp)} GB/s vs {span(ship)} GB/s ({verdict})."
    return text + " On Apple silicon mlx's GPU kernel does this work instead."


def _note_lookup(p: dict) -> str:
    text = (f"**Lookup:** `contains` of a {p['prompt_tokens'] // 1024}K-token prompt (hashing + walk) takes "
            f"{ms(p['contains_np']):.3f} ms for an int32 array "
            f"({'under' if p['met'] else 'over'} the {p['target_ms']:g} ms target)")
    if "walk_only_prompt_index" in p:
        text += (f"; the walk alone takes {ms(p['walk_only']):.3f} ms in an index of {p['blocks_indexed']:,} blocks "
                 f"and {ms(p['walk_only_prompt_index']):.3f} ms in one of the prompt's {p['prompt_blocks']} blocks")
    return text + (f". A Python list costs {ms(p['contains_list']) - ms(p['contains_np']):.2f} ms more, "
                   f"{ms(p['as_tokens_list']):.2f} ms of it to convert (`as_tokens`), so engines should pass arrays.")


def _note_ttft(p: dict, restore: Optional[dict]) -> str:
    es = list(p["lengths"].values())
    fast = [e["speedup_vs_cold"][k] for e in es for k in ("kvstore_ram", "kvstore_ssd", "lru_prompt_cache")]
    text = (f"**TTFT hits** on the {p['model']}, whose KV takes {p['kv_bytes_per_token']:,} B per token, are "
            "dominated by per-request fixed costs (a decode step, cache rebuild): a kvstore RAM hit takes "
            f"{span([e['kvstore_ram_vs_lru'] for e in es])}x the time of an `LRUPromptCache` hit, and hits are "
            f"{span(fast, '{:.0f}')}x faster than a cold prefill.")
    if restore:
        per_token = restore["fp16_bytes"] / restore["shape"]["tokens"]
        text += f" The restore part measures the KV-size-dependent cost, on {per_token:,.0f} B per token."
    return text


def _note_replay(p: dict, restore: Optional[dict]) -> str:
    ideal = p["ideal"]["recomputed_tokens"]
    q = [(b["budget_frac"], b["systems"]["kvstore_q8_ssd"]["recomputed_tokens"]) for b in p["budgets"]]
    if all(r == ideal for _, r in q):
        reach = "kvstore q8 + SSD reaches it at every budget"
    else:
        reach = ("kvstore q8 + SSD recomputes " + ", ".join(f"{r:,} at {f:.0%}" for f, r in q)
                 + f" (unbounded: {ideal:,})")
    bytes_q8 = "in fewer bytes"
    ents = (restore or {}).get("entries", {})
    if "fp16" in ents and "q8" in ents:
        bytes_q8 = f"in {ents['q8']['stored_bytes'] / ents['fp16']['stored_bytes']:.0%} of the fp16 bytes"
    return ("**Replay:** the 'unbounded' row is what any exact prefix cache of unlimited size could serve (the new "
            f"tokens of each turn, plus each system prompt once); {reach}. LRUPromptCache keeps one full copy per "
            "conversation (system prompt included) in fp16, kvstore shares blocks between conversations, stores "
            f"8-bit entries {bytes_q8} and keeps what RAM evicts on SSD.")


def reading_notes(results: dict) -> list[str]:
    """What limits each figure (mechanisms measured in this project; see the sections)."""
    n: list[Optional[str]] = []
    if "restore" in results:
        p = results["restore"]
        n += [_note_ram(p), _note_ssd_cached(p), _note_ssd_cold(p), _note_dequantize(p)]
    if "lookup" in results:
        n.append(_note_lookup(results["lookup"]))
    if "put" in results:
        n.append("**Put** blocks only for hashing and indexing; it never touches the disk. The background thread "
                 "(one, so the engine keeps the other cores) copies each block straight out of the engine's buffers "
                 "into its serialized buffer (one reused from a block evicted or written through), checksumming it on "
                 "the way; a commit thread copies each block into LMDB's writable map as soon as it is handed over (an "
                 "open write transaction of up to 512 MiB), starting each value's write-out as it goes, and commits "
                 "(msync + fsync) at the end of the put.")
    if "ttft" in results:
        n.append(_note_ttft(results["ttft"], results.get("restore")))
    if "replay" in results:
        n.append(_note_replay(results["replay"], results.get("restore")))
    return [x for x in n if x]
