#!/usr/bin/env python
"""Fidelity of stored KV on a trained model and real text.

    kvstore bench fidelity-text --out DIR [--model smollm2|PATH] [--prefix N] [--cont N]
                                [--text FILE ... | --texts-json FILE] [--settings NAME ...] [--greedy N]
                                [--write-docs]
    kvstore bench fidelity-text --save-texts FILE   # the default texts as JSON, for another machine

For each text (by default: license and documentation files shipped with
installed packages, named in the output), the first ``--prefix`` tokens are
prefilled once. That cache is the cold reference. For each storage setting it
is put into a real ``PrefixStore`` on SSD, the store is closed and reopened,
the prefix is fetched back (from LMDB), and the next ``--cont`` tokens run on
the restored cache as on the cold one, in the same single forward pass. Per
setting, over every continuation position of every text:

- max |logit error| and KL(cold || restored) (mean and max over positions),
- top-1 agreement of the next-token prediction,
- perplexity of the true continuation, cold and restored, and its change,
- greedy decoding of ``--greedy`` tokens after the prefix (its next true
  token fed first): the share of texts whose greedy tokens are all identical,
  and the mean identical-prefix fraction.

The dense row stores the engine's own dtype: its errors are exactly zero,
which checks the harness. The model runs in ``load_gguf``'s default dtype:
fp16 on a GPU, fp32 on a CPU (mlx's half-precision CPU kernels are very slow),
and its KV cache with it. Writes ``DIR/fidelity.json`` and ``DIR/fidelity.md``;
``--write-docs`` replaces the fidelity section of ``docs/benchmarks.md`` (which
``kvstore bench`` keeps when it rewrites its own section).

Importable: ``run(...)`` returns the result dict (the test suite runs a short case).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import platform
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# name -> PrefixStore settings; "dense" keeps the engine's dtype
SETTINGS: dict[str, dict[str, Any]] = {
    "dense": dict(kv_bits=None),
    "q8": dict(kv_bits=8),
    "q8 g32": dict(kv_bits=8, kv_group_size=32),
    "q8 rotK+rotV": dict(kv_bits=8, rotate_keys=True, rotate_values=True),
    "q8 g32 rotK+rotV": dict(kv_bits=8, kv_group_size=32, rotate_keys=True, rotate_values=True),
    "q6": dict(kv_bits=6),
    "K8/V4": dict(kv_bits=(8, 4), rotate_keys=False, rotate_values=False),
    "q4": dict(kv_bits=4, rotate_keys=False, rotate_values=False),
    "q4 rotK": dict(kv_bits=4, rotate_keys=True, rotate_values=False),
    "q4 g32": dict(kv_bits=4, kv_group_size=32, rotate_keys=False, rotate_values=False),
    "q4 g32 rotK": dict(kv_bits=4, kv_group_size=32, rotate_keys=True, rotate_values=False),
    "K4 rotK/V8": dict(kv_bits=(4, 8), rotate_keys=True, rotate_values=False),
    "q4 rotK+rotV": dict(kv_bits=4, rotate_keys=True, rotate_values=True),
    "q4 g32 rotK+rotV": dict(kv_bits=4, kv_group_size=32, rotate_keys=True, rotate_values=True),
    "K8/V4 rotV": dict(kv_bits=(8, 4), rotate_keys=False, rotate_values=True),
    # "(full dense)": the full-attention layers of a model with sliding-window layers (Gemma 3's global
    # ones) kept in the engine's dtype, the windowed ones as named; on a model without windows, as named
    "q8 (full dense)": dict(kv_bits=8, full_attention_bits=None),
    "q8 rotK+rotV (full dense)": dict(kv_bits=8, rotate_keys=True, rotate_values=True, full_attention_bits=None),
    "q4 g32 rotK+rotV (full dense)": dict(kv_bits=4, kv_group_size=32, rotate_keys=True, rotate_values=True,
                                          full_attention_bits=None),
    # "(full q8)": those layers at 8 bits, with the named group and rotation
    "q4 g32 rotK+rotV (full q8)": dict(kv_bits=4, kv_group_size=32, rotate_keys=True, rotate_values=True,
                                       full_attention_bits=8),
}

# (distribution, file inside it) of installed packages; "python" is the interpreter's own LICENSE.txt
DEFAULT_TEXTS = [
    ("python", "LICENSE.txt"),
    ("numpy", "LICENSE.txt"),
    ("hypothesis", "LICENSE.txt"),
    ("mlx-lm", "mlx_lm/LORA.md"),
    ("rich", "METADATA"),
    ("regex", "METADATA"),
    ("typer", "METADATA"),
    ("xxhash", "METADATA"),
]

_MARK_BEGIN = "<!-- begin fidelity-trained -->"  # the section of docs/benchmarks.md --write-docs rewrites
_MARK_END = "<!-- end fidelity-trained -->"


@dataclass
class Text:
    name: str  # what it is, e.g. "numpy 2.4.6: LICENSE.txt"
    text: str


def find_text(dist: str, rel: str) -> Optional[Text]:
    """A file shipped by an installed distribution (or Python's own LICENSE.txt)."""
    if dist == "python":
        p = Path(sysconfig.get_paths()["stdlib"]) / rel
        ver = platform.python_version()
    else:
        try:
            d = md.distribution(dist)
        except md.PackageNotFoundError:
            return None
        ver = d.version
        hits = [f for f in (d.files or []) if str(f).endswith(rel) and (f.name == Path(rel).name)]
        hits.sort(key=lambda f: len(str(f)))
        p = Path(d.locate_file(hits[0])) if hits else None
    if p is None or not p.is_file():
        return None
    return Text(f"{dist} {ver}: {rel}", p.read_text(encoding="utf-8", errors="replace"))


def default_texts() -> list[Text]:
    return [t for t in (find_text(d, r) for d, r in DEFAULT_TEXTS) if t is not None]


def save_texts(texts: Sequence[Text], path: Path) -> None:
    """``texts`` as JSON (``[{"name", "text"}]``), for ``--texts-json`` elsewhere."""
    path.write_text(json.dumps([{"name": t.name, "text": t.text} for t in texts], ensure_ascii=False), encoding="utf-8")


def load_texts(path: Path) -> list[Text]:
    return [Text(str(d["name"]), str(d["text"])) for d in json.loads(path.read_text(encoding="utf-8"))]


# ------------------------------------------------------------------ measuring


@dataclass
class _Acc:
    """Per-setting sums over every continuation position of every text."""

    max_err: float = 0.0
    kl: list = field(default_factory=list)
    top1: int = 0
    nll: float = 0.0
    positions: int = 0
    greedy_same: list = field(default_factory=list)
    greedy_prefix: list = field(default_factory=list)
    key_err: list = field(default_factory=list)  # per text and layer: |restored - cold| / |cold|
    value_err: list = field(default_factory=list)

    def row(self, cold_nll: float) -> dict:
        kl = np.concatenate(self.kl) if self.kl else np.zeros(1)
        ppl, ppl0 = math.exp(self.nll / self.positions), math.exp(cold_nll / self.positions)
        return {"max_abs_logit_err": self.max_err, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                "kl_p99": float(np.quantile(kl, 0.99)), "top1_agree": self.top1 / self.positions,
                "ppl": ppl, "ppl_cold": ppl0, "ppl_delta_pct": 100.0 * (ppl / ppl0 - 1.0),
                "greedy_identical": float(np.mean(self.greedy_same)) if self.greedy_same else None,
                "greedy_identical_prefix": float(np.mean(self.greedy_prefix)) if self.greedy_prefix else None,
                "key_rel_err": float(np.mean(self.key_err)), "value_rel_err": float(np.mean(self.value_err)),
                "positions": self.positions}


def _logprobs(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _forward(model, cache, tokens: Sequence[int]) -> mx.array:
    """Logits ``[len(tokens), vocab]`` of one forward pass over ``tokens``."""
    out = model(mx.array(list(tokens))[None], cache=cache)[0]
    mx.eval(out)
    return out


def _rel_err(got: mx.array, want: mx.array) -> float:
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    return float((mx.linalg.norm(g - w) / mx.linalg.norm(w)).item())


def _common_rows(got, want, length: int, which: str) -> tuple[mx.array, mx.array]:
    """The rows both layers hold: a sliding-window layer is served with its window's rows, while the
    cold cache it is compared with may hold more (mlx-lm's rotating buffer keeps a chunk's worth extra)."""
    lo = max(got.start, want.start)
    g, w = getattr(got, which), getattr(want, which)
    return g[..., lo - got.start:length - got.start, :], w[..., lo - want.start:length - want.start, :]


def _greedy(model, cache, first: int, n: int) -> list[int]:
    """Feed ``first``, then ``n`` greedy tokens."""
    out, y = [], first
    for _ in range(n):
        lg = model(mx.array([[y]]), cache=cache)
        y = int(mx.argmax(lg[0, -1]).item())
        out.append(y)
    return out


def _prefill(model, tokens: Sequence[int], step: int = 512) -> list:
    from mlx_lm.models import cache as C

    cache = C.make_prompt_cache(model)
    for i in range(0, len(tokens), step):
        model.model(mx.array(list(tokens[i:i + step]))[None], cache=cache)  # no logits needed
        mx.eval([c.state for c in cache])
    return cache


def run(model_spec: str = "smollm2", texts: Optional[list[Text]] = None, prefix: int = 1536, cont: int = 512,
        settings: Optional[Sequence[str]] = None, greedy: int = 32, tmp: Optional[str] = None,
        log=print, loaded: Optional[tuple] = None) -> dict:
    """Measure every setting on every text; see the module docstring. ``loaded``: ``load_model(model_spec)``'s
    ``(model, tokenizer, path)`` when the caller has it already."""
    from kvstore import PrefixStore
    from kvstore.adapters.generate import model_key
    from kvstore.adapters.gguf import load_model
    from kvstore.adapters.mlx_lm import cache_to_layers, layers_to_cache

    settings = list(settings or SETTINGS)
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    texts = default_texts() if texts is None else texts
    t0 = time.perf_counter()
    model, tok, path = loaded or load_model(model_spec)
    key = model_key(model, path)
    need = prefix + cont + 1
    used, skipped = [], []
    for t in texts:
        ids = list(tok.encode(t.text))
        (used if len(ids) >= need else skipped).append((t, ids))
    if not used:
        raise ValueError(f"no text has the {need} tokens needed (prefix {prefix} + continuation {cont} + 1)")
    acc = {s: _Acc() for s in settings}
    cold_nll = 0.0
    kv_dtype = None
    with tempfile.TemporaryDirectory(dir=tmp, prefix="kvstore-fidelity-") as d:
        for ti, (t, ids) in enumerate(used):
            head, nxt, targets = ids[:prefix], ids[prefix:prefix + cont], ids[prefix + 1:prefix + cont + 1]
            layers = cache_to_layers(_prefill(model, head))
            kv_dtype = kv_dtype or str(layers[0].keys.dtype).split(".")[-1]
            lg0 = _forward(model, layers_to_cache(layers, model, length=prefix), nxt)
            lp0 = _logprobs(lg0)
            g0 = _greedy(model, layers_to_cache(layers, model, length=prefix), nxt[0], greedy) if greedy else []
            tgt = mx.array(targets)
            cold_nll += float(-mx.take_along_axis(lp0, tgt[:, None], axis=-1).sum().item())
            top0 = mx.argmax(lp0, axis=-1)
            p0 = mx.exp(lp0)
            for s in settings:
                kw = dict(budget_gb=1, block_size=256, ssd_path=Path(d, s.replace("/", "_").replace(" ", "_")),
                          **SETTINGS[s])
                with PrefixStore(**kw) as store:
                    store.put(key, head, layers)
                with PrefixStore(**kw) as store:  # reopened: the prefix comes from LMDB
                    hit = store.fetch(key, head)
                if hit.length != prefix or hit.ssd_tokens != prefix:
                    raise RuntimeError(f"{s}: fetched {hit.length} tokens ({hit.ssd_tokens} from SSD), "
                                       f"expected all {prefix} from SSD")
                lg = _forward(model, layers_to_cache(hit.layers, model, length=prefix), nxt)
                lp = _logprobs(lg)
                a = acc[s]
                a.key_err += [_rel_err(*_common_rows(r, c, prefix, "keys")) for r, c in zip(hit.layers, layers)]
                a.value_err += [_rel_err(*_common_rows(r, c, prefix, "values")) for r, c in zip(hit.layers, layers)]
                a.max_err = max(a.max_err, float(mx.max(mx.abs(lg.astype(mx.float32) - lg0.astype(mx.float32))).item()))
                a.kl.append(np.array(mx.sum(p0 * (lp0 - lp), axis=-1)))
                a.top1 += int(mx.sum(mx.argmax(lp, axis=-1) == top0).item())
                a.nll += float(-mx.take_along_axis(lp, tgt[:, None], axis=-1).sum().item())
                a.positions += len(targets)
                if greedy:
                    g = _greedy(model, layers_to_cache(hit.layers, model, length=prefix), nxt[0], greedy)
                    same = next((i for i, (x, y) in enumerate(zip(g, g0)) if x != y), greedy)
                    a.greedy_same.append(same == greedy)
                    a.greedy_prefix.append(same / greedy)
            log(f"fidelity: text {ti + 1}/{len(used)} ({t.name}) done, {time.perf_counter() - t0:.0f} s")
    positions = acc[settings[0]].positions
    return {
        "model": str(model_spec), "model_path": str(path), "kv_dtype": kv_dtype, "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "mlx": mx.__version__, "machine": f"{platform.system()} {platform.machine()}",
        "prefix": prefix, "cont": cont, "greedy_tokens": greedy, "continuation_tokens": positions,
        "texts": [{"name": t.name, "tokens": len(ids)} for t, ids in used],
        "texts_too_short": [{"name": t.name, "tokens": len(ids)} for t, ids in skipped],
        "settings": {s: dict(SETTINGS[s], kv_bits=SETTINGS[s].get("kv_bits")) for s in settings},
        "rows": {s: acc[s].row(cold_nll) for s in settings},
        "seconds": time.perf_counter() - t0,
    }


# ----------------------------------------------------------------------- docs


def table(res: dict) -> str:
    """The markdown section for docs/benchmarks.md."""
    L = [_MARK_BEGIN, f"## fidelity on a trained model: {model_title(res)} on real text\n"]
    texts = "; ".join(f"{t['name']} ({t['tokens']:,} tokens)" for t in res["texts"])
    L.append(f"Model: `{Path(res['model_path']).name}` ({res['model']}; mlx {res['mlx']}, {res['device']}, "
             f"{res['machine']}; KV in {res['kv_dtype']}). Texts: {texts}. Per text the first {res['prefix']:,} "
             f"tokens are prefilled, stored through a `PrefixStore` on SSD, the store is reopened and the prefix "
             f"fetched from LMDB; the next {res['cont']} tokens run on the restored and on the cold cache in one "
             f"forward pass: {res['continuation_tokens']:,} continuation positions per row. Greedy: "
             f"{res['greedy_tokens']} tokens after the prefix, all identical (share of texts) and identical prefix "
             f"(mean fraction). 'rotK' / 'rotV': keys / values rotated (Hadamard with seeded signs) before "
             f"quantizing; group 64 unless 'g32'; '(full dense)': full-attention layers of a model with "
             f"sliding-window layers kept dense ('(full q8)': at 8 bits).\n")
    L.append("| entries | K / V rel. error | max abs logit err | mean KL | p99 KL | max KL | top-1 agree "
             "| perplexity (cold) | ppl delta | greedy identical | greedy identical prefix |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res["rows"].items():
        g = "-" if r["greedy_identical"] is None else f"{r['greedy_identical']:.0%}"
        gp = "-" if r["greedy_identical_prefix"] is None else f"{r['greedy_identical_prefix']:.0%}"
        L.append(f"| {name} | {r['key_rel_err']:.4f} / {r['value_rel_err']:.4f} | {r['max_abs_logit_err']:.4f} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | "
                 f"{r['kl_max']:.2e} | {r['top1_agree']:.2%} | {r['ppl']:.4f} ({r['ppl_cold']:.4f}) | "
                 f"{r['ppl_delta_pct']:+.3f}% | {g} | {gp} |")
    L.append("")
    L += [f"- {line}" for line in summary(res)]
    L.append("")
    chosen = list(res["rows"])
    settings = "" if chosen == list(SETTINGS) else " --settings " + " ".join(f"'{c}'" if " " in c else c
                                                                            for c in chosen)
    L.append(f"Command: `kvstore bench fidelity-text --out DIR --prefix {res['prefix']} --cont {res['cont']} "
             f"--greedy {res['greedy_tokens']}{settings}` ({res['seconds'] / 60:.0f} min).\n")
    L.append(_MARK_END)
    return "\n".join(L)


_TITLES = {"SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M-Instruct", "gemma-3-270m-q4_k_m.gguf": "Gemma 3 270M"}


def model_title(res: dict) -> str:
    """The model's name for a heading: the known trained models by name, others by file or folder."""
    name = Path(res["model_path"]).name
    return _TITLES.get(name, name)


def _bits(name: str) -> tuple[Optional[int], Optional[int]]:
    b = SETTINGS[name]["kv_bits"]
    return (b, b) if b is None or isinstance(b, int) else b


def summary(res: dict) -> list[str]:
    """The targets (q8: top-1 >= 99.5 %, perplexity within 0.1 %; best 4-bit setting within 1 %) and
    what rotating keys changed, read off the rows."""
    rows, out = res["rows"], []
    verdict = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731
    for name in ("q8", "q8 (full dense)", "q8 rotK+rotV (full dense)"):
        if name in rows:
            r = rows[name]
            out.append(f"{name} entries: top-1 agreement {r['top1_agree']:.2%} (target >= 99.5%: "
                       f"{verdict(r['top1_agree'] >= 0.995)}), perplexity {r['ppl_delta_pct']:+.3f}% "
                       f"(target within 0.1%: {verdict(abs(r['ppl_delta_pct']) <= 0.1)}).")
    four = [n for n in rows if all(b is not None and b <= 4 for b in _bits(n))]
    if four:
        by_ppl = min(four, key=lambda n: abs(rows[n]["ppl_delta_pct"]))
        by_kl = min(four, key=lambda n: rows[n]["kl_mean"])
        r = rows[by_ppl]
        line = (f"Best 4-bit setting by perplexity: {by_ppl}, {r['ppl_delta_pct']:+.3f}% (target within 1%: "
                f"{verdict(abs(r['ppl_delta_pct']) <= 1.0)}), top-1 {r['top1_agree']:.2%}")
        if by_kl != by_ppl:
            k = rows[by_kl]
            line += (f"; lowest mean KL: {by_kl} ({k['kl_mean']:.2e}, perplexity {k['ppl_delta_pct']:+.3f}%, "
                     f"top-1 {k['top1_agree']:.2%})")
        out.append(line + ".")
    pairs = [("keys", "q4", "q4 rotK"), ("keys", "q4 g32", "q4 g32 rotK"), ("values", "q4 rotK", "q4 rotK+rotV"),
             ("values", "q4 g32 rotK", "q4 g32 rotK+rotV"), ("values", "K8/V4", "K8/V4 rotV")]
    for which, plain, rot in pairs:
        if plain in rows and rot in rows:
            a, b, e = rows[plain], rows[rot], f"{which[:-1]}_rel_err"
            out.append(f"Rotating {which}, {plain} -> {rot}: {which[:-1]} error {a[e]:.4f} -> {b[e]:.4f}, "
                       f"mean KL {a['kl_mean']:.2e} -> {b['kl_mean']:.2e}, perplexity "
                       f"{a['ppl_delta_pct']:+.3f}% -> {b['ppl_delta_pct']:+.3f}%, top-1 {a['top1_agree']:.2%} -> "
                       f"{b['top1_agree']:.2%}.")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench fidelity-text", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder (fidelity.json); required unless --save-texts")
    ap.add_argument("--model", default="smollm2", help="'smollm2', a GGUF file or an mlx-lm model folder")
    ap.add_argument("--prefix", type=int, default=1536, help="stored prefix tokens per text")
    ap.add_argument("--cont", type=int, default=512, help="continuation tokens per text")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens per text (0: skip)")
    ap.add_argument("--text", action="append", metavar="FILE", help="a text file (repeatable; default: license "
                    "and documentation files of installed packages)")
    ap.add_argument("--texts-json", metavar="FILE", help="texts saved by --save-texts (their names kept): the "
                    "same texts on a machine whose installed packages differ")
    ap.add_argument("--save-texts", metavar="FILE", help="write the texts (default or --text) as JSON and exit")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), metavar="NAME",
                    help=f"storage settings (default: all of {', '.join(SETTINGS)})")
    ap.add_argument("--tmp", help="folder for the stores (default: the system's temp folder)")
    ap.add_argument("--write-docs", action="store_true", help="replace the section in docs/benchmarks.md")
    a = ap.parse_args(argv)
    texts = None
    if a.text:
        texts = [Text(Path(f).name, Path(f).read_text(encoding="utf-8", errors="replace")) for f in a.text]
    elif a.texts_json:
        texts = load_texts(Path(a.texts_json))
    if a.save_texts:
        chosen = default_texts() if texts is None else texts
        save_texts(chosen, Path(a.save_texts))
        print(f"{len(chosen)} texts written to {a.save_texts}")
        return 0
    if not a.out:
        ap.error("--out is required")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = run(a.model, texts, a.prefix, a.cont, a.settings, a.greedy, a.tmp, log)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(res, indent=1))
    section = table(res)
    (out / "fidelity.md").write_text(section + "\n")
    print(section)
    if a.write_docs:
        from kvstore.tools.bench.common import splice

        splice(ROOT / "docs" / "benchmarks.md", (_MARK_BEGIN, _MARK_END), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
