"""The plots of the parts that have one (PNG files next to the JSON)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .common import MiB
from .replay import SYSTEMS


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> list[str]:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return [path.name]


def restore(res: dict, out: Path) -> list[str]:
    plt = _pyplot()
    names = list(res["entries"])
    series = [("RAM", "ram"), ("RAM, Quantized", "ram_quantized"), ("SSD page-cached", "ssd_page_cached"),
              ("SSD cold", "ssd_cold"), ("SSD cold, I/O path, LMDB readahead off", "ssd_cold_ra_off"),
              ("SSD cold, I/O path, LMDB readahead on", "ssd_cold_ra_on")]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=80)
    w = 0.8 / (len(series) + 3)
    x = np.arange(len(names))
    i = 0
    for label, k in series:
        vals = [res["entries"][n].get(k, {}).get("gbps", 0) for n in names]
        ax.bar(x + i * w, vals, w, label=label)
        i += 1
    for label, k in (("numpy memcpy", "numpy_copy"), ("mx.array copy", "mx_array_copy"),
                     ("plain read, cached", "read_page_cached")):
        vals = [res["entries"][n]["baselines"][k]["gbps"] for n in names]
        ax.bar(x + i * w, vals, w, label=label, hatch="//", alpha=0.6)
        i += 1
    ax.set_xticks(x + w * (i - 1) / 2)
    ax.set_xticklabels(names)
    ax.set_ylabel("GB/s of stored bytes")
    ax.set_title("fetch throughput (median)")
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, out / "restore.png")


def ttft(res: dict, out: Path) -> list[str]:
    plt = _pyplot()
    lens = [int(k) for k in res["lengths"]]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    for label, k, m in (("cold prefill", "cold", "o"), ("kvstore RAM hit", "kvstore_ram", "s"),
                        ("kvstore SSD hit (page-cached)", "kvstore_ssd", "^"),
                        ("kvstore SSD hit (cold)", "kvstore_ssd_cold", "v"),
                        ("mlx-lm LRUPromptCache hit", "lru_prompt_cache", "x")):
        ax.plot(lens, [res["lengths"][str(n)][k]["median_s"] * 1e3 for n in lens], marker=m, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title("time to first token, tiny llama (mlx CPU)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, out / "ttft.png")


def replay(res: dict, out: Path) -> list[str]:
    plt = _pyplot()
    names = [n for n, _ in SYSTEMS]
    labels = [dict(SYSTEMS)[n].replace("kvstore ", "kvstore\n").replace("mlx-lm ", "mlx-lm\n") for n in names]
    budgets = res["budgets"]
    fig, axs = plt.subplots(1, 3, figsize=(10.5, 3.4), dpi=80)
    x = np.arange(len(names))
    w = 0.8 / len(budgets)
    for i, b in enumerate(budgets):
        lab = f"budget {b['ram_budget_bytes'] / MiB:.1f} MiB ({b['budget_frac']:.0%})"
        axs[0].bar(x + (i - (len(budgets) - 1) / 2) * w, [b["systems"][n]["recomputed_tokens"] / 1e3 for n in names], w,
                   label=lab)
        axs[1].bar(x + (i - (len(budgets) - 1) / 2) * w, [b["systems"][n]["ttft_total_s"] for n in names], w, label=lab)
    axs[0].axhline(res["ideal"]["recomputed_tokens"] / 1e3, color="k", ls="--", lw=1, label="unbounded cache")
    axs[0].set_ylabel("prompt tokens recomputed (K)")
    axs[1].set_ylabel("total TTFT (s)")
    axs[0].legend(fontsize=6)
    axs[1].legend(fontsize=6)
    s0 = budgets[0]["systems"]
    axs[2].bar(x - 0.2, [s0[n]["ttft_p50_s"] * 1e3 for n in names], 0.4, label="p50")
    axs[2].bar(x + 0.2, [s0[n]["ttft_p95_s"] * 1e3 for n in names], 0.4, label="p95")
    axs[2].set_ylabel(f"TTFT (ms), budget {budgets[0]['budget_frac']:.0%}")
    axs[2].legend(fontsize=7)
    for ax in axs:
        ax.set_xticks(x)
        ax.set_xticklabels(labels)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"replay: {res['requests']} requests, {res['prompt_tokens']:,} prompt tokens, working set "
                 f"{res['working_set_fp16_bytes'] / MiB:.1f} MiB fp16 KV (tiny llama, mlx CPU)", fontsize=9)
    return _save(plt, fig, out / "replay.png")


PLOTS = {"restore": restore, "ttft": ttft, "replay": replay}
