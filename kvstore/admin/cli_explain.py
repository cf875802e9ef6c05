"""``kvstore explain``: why one prompt would miss, block by block (``PrefixStore.explain``, a dry run of the
fetch on the store opened read-only: safe beside running engines, whose RAM it does not see)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Union

import typer
from rich.markup import escape
from rich.table import Table

from ..blocks.hashing import root_key
from ..tiers.disk.lmdb import LmdbTier
from .catalog import display_names
from .exits import fail
from .tokens import encode, tokenizer
from .ui import flag, out

SEEN_HERE = "an engine's RAM and device copies are its own process's: not seen from here"
LOADS = {"ram": "loads from memory", "ssd_cached": "loads from the page cache", "ssd_cold": "loads from SSD (cold)"}


def explain_(
    path: Path = typer.Argument(..., help="The store directory (the ssd_path the engine used).", show_default=False),
    model: str = typer.Option(..., "--model", help="The model, as `kvstore inspect` names it (or its model key).",
                              show_default=False),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The prompt's text, tokenized with the model's "
                                         "tokenizer as it is (no chat template: for a chat, --tokens)."),
    tokens: Optional[Path] = typer.Option(None, "--tokens", help="A file of the prompt's token ids: a JSON list "
                                          "or integers separated by white space ('-': standard input)."),
    as_json: bool = flag("--json", help="One JSON object: the cost model's verdict, the totals and every block."),
    remote: Optional[str] = typer.Option(None, "--remote", help="The engines' shared remote tier (redis://, "
                                         "rediss://, unix://), asked for its records only."),
    policy: str = typer.Option("auto", help="The engines' fetch_policy: auto (weighs the rates this machine "
                               "measured, kept in the store), always or never."),
):
    """Why a prompt would miss: block by block, where the store holds it (device, RAM, disk, remote, nowhere),
    why a block would not be served (new, evicted, tail, other_model, declined, ...) and what the cost model
    would choose and why. Loads and changes nothing: safe while engines use the store.

    Example: [bold]kvstore explain ~/.cache/kvstore/store --model my-model --prompt "You are a helpful ..."[/bold]
    """
    if (prompt is None) == (tokens is None):
        fail("give the prompt as --prompt TEXT or its token ids as --tokens FILE (one of them)")
    key, namespace, info = _model(path, model)
    ids = _tokens(tokens) if tokens is not None else _encoded(model, info, prompt)
    from .. import PrefixStore  # (the facade, through the package's public name: this command opens a store)

    with PrefixStore(ssd_path=path.expanduser(), readonly=True, namespace=namespace, remote=remote,
                     fetch_policy=policy) as store:
        e = store.explain(key, ids)
    if as_json:
        print(json.dumps(e.to_dict()))
        return
    _show(path, e)


def _model(path: Path, name: str) -> tuple[Union[str, bytes], Optional[str], dict]:
    """The model key, namespace and description of the model ``name`` names (as ``inspect`` shows it, its
    registered name or its model key)."""
    tier = LmdbTier.open(path.expanduser(), readonly=True)
    try:
        models = tier.models()
    finally:
        tier.close()
    shown = display_names(models)
    roots = [r for r, info in models.items() if name in (info.get("model_key"), info.get("name"), shown[r])]
    if len(roots) != 1:
        listed = ", ".join(sorted(shown.values())) or "none"
        fail(f"{path}: {len(roots)} models named {name!r} (`kvstore inspect` names them: {listed})" if roots else
             f"{path}: no model {name!r} stored (`kvstore inspect` names them: {listed})")
    root, info = roots[0], models[roots[0]]
    ns, mk = info.get("namespace"), str(info.get("model_key") or "")
    for key in (mk, _hex(mk)):  # (a model key given as bytes is registered as its hex)
        if key and root_key(key, ns) == root:
            return key, ns, info
    fail(f"{path}: the model {name!r} is registered without the key it was stored under")


def _hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


def _tokens(file: Path) -> list[int]:
    """Token ids from a file: a JSON list, or integers separated by white space."""
    text = sys.stdin.read() if str(file) == "-" else file.expanduser().read_text()
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except ValueError as e:
        fail(f"{file}: not a JSON list of token ids nor integers separated by white space ({e})")
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        fail(f"{file}: no token ids (a JSON list of integers, or integers separated by white space)")
    return ids


def _encoded(name: str, info: dict, text: str) -> list[int]:
    folder = info.get("path")
    try:
        tok = tokenizer(Path(folder)) if folder and Path(folder).exists() else None
    except Exception as e:
        fail(f"{folder}: cannot read the tokenizer of {name!r} ({type(e).__name__}: {e}); give --tokens FILE")
    if tok is None:
        fail(f"no tokenizer found for {name!r} (registered folder: {folder or 'none'}); give its token ids with "
             f"--tokens FILE")
    ids = encode(tok, text)
    if not ids:
        fail("the prompt has no tokens")
    return ids


def _show(path: Path, e) -> None:
    """The header, the blocks (runs of alike blocks as one row) and the totals, for a person."""
    out.print(f"[bold]{escape(e.model)}[/bold] in {escape(str(path))}: {e.tokens} prompt tokens"
              + (f" (asked for {e.limit})" if e.limit < e.tokens else "") + f", blocks of {e.block_size}")
    out.print(f"tiers seen: {', '.join(t for t in e.tiers if t != 'ram')} ({SEEN_HERE})")
    out.print(f"cost model (fetch_policy {e.verdict.policy}): {escape(verdict(e.verdict))}")
    table = Table(show_edge=False)
    for col in ("blocks", "tokens", "where", "served", "not served", "note"):
        table.add_column(col, justify="right" if col in ("served",) else "left")
    for run in _runs(e.blocks):
        first, last = run[0], run[-1]
        missed: dict[str, int] = {}
        for b in run:
            for r, k in b.not_served.items():
                missed[r] = missed.get(r, 0) + k
        note = f"held by {first.held_by}" if first.held_by else LOADS.get(first.loads_from, "")
        table.add_row(str(first.index) if len(run) == 1 else f"{first.index}-{last.index}",
                      f"{first.start}-{last.end}", first.where, str(sum(b.served for b in run)),
                      ", ".join(f"{r} {k}" for r, k in missed.items()), escape(note))
    out.print(table)
    share = 100 * e.served / e.tokens if e.tokens else 0.0
    out.print(f"served {e.served} ({share:.0f}%), not served {e.tokens - e.served}"
              + "".join(f", {r} {k}" for r, k in sorted(e.not_served.items(), key=lambda kv: -kv[1])))


def verdict(v) -> str:
    """The cost model's choice in words, with its predicted times."""
    if not v.servable:
        return "nothing to weigh: no stored block serves the prompt"
    said = f"serve {v.length} of {v.servable} servable tokens"
    if v.recompute_s is not None and v.length and (v.load_s or v.prefill_s):  # (weighed, not the policy's)
        said += (f": loading them {v.load_s * 1e3:.1f} ms + prefilling the rest {v.prefill_s * 1e3:.1f} ms, "
                 f"against {v.recompute_s * 1e3:.1f} ms to recompute the whole prompt (predicted)")
    elif v.recompute_s is not None and v.prefill_s:
        said += f": recompute the whole prompt, {v.recompute_s * 1e3:.1f} ms (predicted)"
    return said + (f"; {v.reason}" if v.reason else "")


def _runs(blocks: list) -> list[list]:
    """Consecutive blocks alike (where, how served, why not, held by whom) as one run."""
    runs: list[tuple[tuple, list]] = []
    for b in blocks:
        sig = (b.where, b.loads_from, b.held_by, b.served == b.end - b.start, tuple(sorted(b.not_served)))
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(b)
        else:
            runs.append((sig, [b]))
    return [r for _, r in runs]
