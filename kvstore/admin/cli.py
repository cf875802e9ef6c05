"""The store commands of ``kvstore``: look into, check and clean an SSD store.

They read LMDB and nothing else; the commands that need an engine (demo,
bench, serve) are added by ``kvstore.adapters.cli``, the console script.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from .. import __version__
from .catalog import Catalog, check_block, parse_age, select
from ..cost.model import CostModel
from ..errors import StoreOpenError
from ..hit import REASONS
from ..tiers.disk.lmdb import LmdbTier
from .cli_transfer import export_, import_
from .cli_remote import (clear_remote as _clear_remote, path_or_remote as _path_or_remote,
                         print_remote_stats as _print_remote_stats, remote_catalog as _remote_catalog)
from .cli_explain import explain_
from .exits import run_app
from .tokens import TOKENIZER_LOADERS, tokenizer as _tokenizer  # (TOKENIZER_LOADERS: kvstore.adapters adds to it)
from .ui import err, flag, out, size as _size
from ..tiers.disk.users import other_processes

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="kvstore: a tiered, persistent prefix KV cache for mlx-lm engines.")


def _print_version(value: bool) -> None:
    if value:
        print(f"kvstore {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print kvstore's version and exit.")):
    """kvstore: a tiered, persistent prefix KV cache for mlx-lm engines."""

PathArg = typer.Argument(..., help="The store directory (the ssd_path the engine used).", show_default=False)
OptionalPathArg = typer.Argument(None, help="The store directory (the ssd_path the engine used).", show_default=False)
RemoteOpt = typer.Option(None, "--remote", help="A shared remote tier: redis://[:password@]host:port/db, rediss://, "
                         "unix://; the password may come from $KVSTORE_REMOTE_PASSWORD or $REDISCLI_AUTH.")
NamespaceOpt = typer.Option(None, "--namespace", help="With --remote: only this namespace (default: every one).")


class SortKey(str, Enum):
    last_used = "last-used"
    tokens = "tokens"
    bytes = "bytes"
    hits = "hits"
    created = "created"


def _open(path: Path, readonly: bool = True) -> LmdbTier:
    """An existing store: a command never creates one (a typo in a path is an error, not a new store)."""
    path = path.expanduser()
    if not readonly and (not path.exists() or path.is_dir() and not (path / "data.mdb").is_file()):
        # (a read-only open refuses these itself; a writable one would make a store)
        err.print(f"[red]error:[/red] {path}: no kvstore store here (no data.mdb). Check the path; nothing was "
                  f"created or changed.")
        raise typer.Exit(2)
    try:
        return LmdbTier.open(path, readonly=readonly)
    except StoreOpenError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _decoder(catalog: Catalog):
    """Per model root, a function turning token ids into text, when the model
    folder or file named at registration is still there. A tokenizer that
    cannot be read or decode (another user's folder, a damaged file) leaves
    the ids shown as they are, with one warning per model: never an error."""
    cache = {}

    def decode(root_hex: str, ids: list[int]) -> Optional[str]:
        path = catalog.models.get(bytes.fromhex(root_hex), {}).get("path")
        try:
            if root_hex not in cache:
                cache[root_hex] = None
                if path and Path(path).exists():
                    cache[root_hex] = _tokenizer(Path(path))
            tok = cache[root_hex]
            return None if tok is None else _decode_runs(tok, ids)
        except Exception as e:
            cache[root_hex] = None
            err.print(f"[yellow]warning:[/yellow] {escape(str(path))}: cannot read its tokenizer "
                      f"({type(e).__name__}: {escape(' '.join(str(e).split())[:120])}): token ids shown "
                      f"(as --no-decode)", highlight=False)
            return None
    return decode


def _decode_runs(tok, ids: list[int]) -> str:
    """Text of ``ids``; a run of negative ids (mlx-lm's key for an image's
    patch tokens) reads ``<image>``."""
    out, run = [], []
    for i, t in enumerate(ids):
        if t >= 0:
            run.append(t)
        elif i == 0 or ids[i - 1] != t:
            out += [tok.decode(run, skip_special_tokens=False), "<image>"]
            run = []
    return "".join(out + [tok.decode(run, skip_special_tokens=False)])


@app.command()
def inspect(
    path: Path = PathArg,
    as_json: bool = flag("--json", help="One JSON object per line, for scripts."),
    model: Optional[str] = typer.Option(None, help="Only models whose name or root key starts with this."),
    min_tokens: int = typer.Option(0, min=0, help="Only entries of at least this many tokens."),
    sort: SortKey = typer.Option(SortKey.last_used, help="Order of the rows (largest / newest first)."),
    limit: int = typer.Option(50, min=0, help="At most this many rows (0: all)."),
    decode: bool = typer.Option(True, help="Show the first tokens as text when the model's tokenizer is found."),
):
    """List the stored prompts of a store: model, length, blocks, bytes, KV bits, use.

    Opens the store read-only: safe while an engine writes to it.

    Example: [bold]kvstore inspect ~/.cache/kvstore/store --sort tokens --min-tokens 1000[/bold]
    """
    disk = _open(path)
    try:
        cat = Catalog.read(disk)
    finally:
        disk.close()
    rows = [e for e in cat.entries() if e.tokens >= min_tokens
            and (model is None or e.model.startswith(model) or e.root.startswith(model))]
    attr = {"last-used": "last_used"}.get(sort.value, sort.value)
    rows.sort(key=lambda e: getattr(e, attr), reverse=True)
    if limit:
        rows = rows[:limit]
    decoder = _decoder(cat) if decode else None
    for e in rows:
        if decoder is not None:
            e.text = decoder(e.root, e.first_tokens)
            e.tail_text = decoder(e.root, e.tail_tokens) if e.differs_at else e.text
    if as_json:
        for e in rows:
            out.print_json(json.dumps(e.as_dict()), indent=None) if sys.stdout.isatty() else print(json.dumps(e.as_dict()))
        return
    table = Table(title=f"{path}: {len(cat.records)} blocks, {len(list(cat.entries()))} entries")
    for col in ("model", "prompt", "tokens", "blocks", "bytes", "kv", "dtype", "created", "last used", "hits"):
        table.add_column(col, justify="right" if col in ("tokens", "blocks", "bytes", "hits") else "left",
                         overflow="fold", max_width=36 if col == "prompt" else None)
    for e in rows:
        table.add_row(e.model, _prompt(e), str(e.tokens), str(e.blocks), _size(e.bytes), e.kv, e.dtype,
                      _when(e.created), _when(e.last_used), str(e.hits))
    out.print(table)


def _prompt(e) -> str:
    """An entry's prompt where it parts from the others of its model (``@N``:
    from its N-th token; rows sharing a system prompt differ after it)."""
    text = e.tail_text if e.differs_at else e.text
    shown = repr(text[:60]) if text is not None else " ".join(map(str, e.tail_tokens[:8])) + " …"
    return f"@{e.differs_at} {shown}" if e.differs_at else shown


@app.command()
def stats(path: Optional[Path] = OptionalPathArg, as_json: bool = flag("--json", help="JSON output."),
          remote: Optional[str] = RemoteOpt, namespace: Optional[str] = NamespaceOpt):
    """Totals of a store: per model, disk budget use, hit rate and tokens saved over its life;
    with --remote, what a shared Redis / Valkey tier holds per model and its eviction settings.

    Example: [bold]kvstore stats ~/.cache/kvstore/store[/bold]   or   [bold]kvstore stats --remote redis://cache:6379/0[/bold]
    """
    _path_or_remote(path, remote)
    remote_result = _remote_catalog(remote, namespace).summary() if remote is not None else None
    if path is None:
        print(json.dumps(remote_result)) if as_json else _print_remote_stats(remote_result)
        return
    disk = _open(path)
    try:
        cat = Catalog.read(disk)
        counters = disk.get_counters()
        usage, budget = disk.usage(), disk.get_info("budget")
        measured = _measured_rates(disk.get_info("rates") or {}, cat)
    finally:
        disk.close()
    requested = counters.get("tokens_requested", 0)
    served = sum(counters.get(k, 0) for k in ("tokens_ram", "tokens_ssd", "tokens_remote"))
    result = {
        "path": str(path), "blocks": len(cat.records), "entries": sum(1 for _ in cat.entries()),
        "bytes_used": usage, "disk_budget": budget, "orphans": len(cat.orphans()),
        "models": cat.per_model(), "lifetime": counters,
        "token_hit_rate": served / requested if requested else 0.0, "tokens_saved": served,
        "tokens_skipped_cost": counters.get("tokens_skipped_cost", 0), "rates": measured,
        "tokens_not_served": {r: counters.get("not_served_" + r, 0) for r in REASONS},
    }
    if remote_result is not None:
        result["remote"] = remote_result
    if as_json:
        print(json.dumps(result))
        return
    _print_stats(path, result, counters, usage, budget, served)
    if remote_result is not None:
        _print_remote_stats(remote_result)


def _print_stats(path: Path, result: dict, counters: dict, usage: int, budget: Optional[int], served: int) -> None:
    """``stats``' tables and lines for a person."""
    cat_blocks, measured = result["blocks"], result["rates"]
    t = Table(title=f"{path}")
    t.add_column("model")
    for c in ("blocks", "tokens", "bytes", "block hits"):
        t.add_column(c, justify="right")
    for name, d in result["models"].items():
        t.add_row(name[:24], str(d["blocks"]), str(d["tokens"]), _size(d["bytes"]), str(d["hits"]))
    out.print(t)
    out.print("block hits: times one of the model's blocks was served (a hit of 10 blocks counts 10)")
    used = f"{_size(usage)} of {_size(budget)} ({100 * usage / budget:.1f}%)" if budget else _size(usage)
    out.print(f"disk: {used}    blocks: {cat_blocks}    entries: {result['entries']}")
    out.print(f"lifetime: {counters.get('hits', 0)} fetches hit, {counters.get('misses', 0)} missed, "
              f"token hit rate {100 * result['token_hit_rate']:.1f}%, tokens served from cache {served} "
              f"(RAM {counters.get('tokens_ram', 0)}, SSD {counters.get('tokens_ssd', 0)}, "
              f"remote {counters.get('tokens_remote', 0)})")
    unadmitted = counters.get("evicted_unadmitted", 0)  # (only ssd_admit=reuse leaves blocks unwritten)
    out.print(f"SSD writes: {counters.get('blocks_written', 0)} blocks, {_size(counters.get('bytes_written', 0))}"
              + (f"; {unadmitted} blocks left RAM never written (ssd_admit=reuse)" if unadmitted else ""))
    why = sorted(((r, k) for r, k in result["tokens_not_served"].items() if k), key=lambda rk: -rk[1])
    if why:  # (stores written before the reasons were counted have none)
        out.print("tokens not served, by reason: " + ", ".join(f"{r} {k:,}" for r, k in why)
                  + " (one prompt, block by block: kvstore explain)")
    pred, act = counters.get("predicted_us", 0), counters.get("actual_us", 0)
    out.print(f"cost: {result['tokens_skipped_cost']} stored tokens recomputed (predicted faster, or a near tie)"
              + (f"; served hits took {act / 1e3:.1f} ms against {pred / 1e3:.1f} ms predicted" if pred else ""))
    for machine, d in measured.items():
        rates = ", ".join(f"{s} {r['gb_per_s']:.2f} GB/s " + (f"({r['observed']} read{'s' * (r['observed'] != 1)} "
                                                                f"timed)" if r["observed"] else "(a prior, not timed)")
                          for s, r in d["rates"].items())
        out.print(f"measured on {machine}: {rates or 'no fetch yet'}")
        for model, m in d["prefill"].items():
            rate = m.get("tokens_per_s_at_8k")
            out.print(f"  prefill of {model[:24]}: " + (f"{rate:,.0f} tokens/s at 8K ({m['observed']} requests)"
                                                         if rate else f"{m['observed']} requests, not fitted yet"))


def _measured_rates(saved: dict, cat: Catalog) -> dict:
    """The cost model's estimates per machine, with model names for root keys."""
    out = {}
    for machine, d in saved.items():
        cm = CostModel()
        cm.merge_saved(d if isinstance(d, dict) else {})
        desc = cm.describe()
        prefill = {}
        for root_hex, m in desc["prefill"].items():
            try:
                name = cat.model_name(bytes.fromhex(root_hex))
            except ValueError:
                name = root_hex
            prefill[name] = m
        out[machine] = {"rates": desc["rates"], "prefill": prefill}
    return out


@app.command()
def verify(path: Path = PathArg,
           repair: bool = typer.Option(False, help="Remove bad blocks (and the blocks under them) and orphans."),
           as_json: bool = flag("--json", help="One JSON object (counts, and each bad block or orphan), for scripts.")):
    """Check every block's header, checksum and tokens. Exit code 0 when all is well, 1 when a block is bad.

    Orphans (blocks whose parent was removed, e.g. by a clear while an older kvstore wrote) are never served
    and are no damage: they are counted apart and do not fail the check; --repair removes them too.

    Example: [bold]kvstore verify ~/.cache/kvstore/store --repair[/bold]
    """
    disk = _open(path, readonly=not repair)
    try:
        cat = Catalog.read(disk)
        bad, orphans = _checked(disk, cat)
        found = [{"key": key.hex(), "tokens": [r.start, r.end] if (r := cat.records.get(key)) else None,
                  "why": why, "orphan": key in orphans} for key, why in bad.items()]
        for f in [] if as_json else found:
            where = "tokens {}-{}".format(*f["tokens"]) if f["tokens"] else "tokens ?"
            tag = "[yellow]orphan[/yellow]" if f["orphan"] else "[red]bad[/red]"
            out.print(f"{tag} {f['key'][:16]} {where}: {f['why']}")
        removed = len(disk.remove(cat.with_descendants(bad))) if bad and repair else 0
        if removed and not as_json:
            out.print(f"removed {removed} blocks")
    finally:
        disk.close()
    n_bad = len(bad) - len(orphans)
    if as_json:
        print(json.dumps({"path": str(path), "checked": len(cat.records) + len(cat.bad), "bad": n_bad,
                          "orphans": len(orphans), "removed": removed, "blocks": found}))
        raise typer.Exit(1 if n_bad else 0)
    out.print(f"{len(cat.records) + len(cat.bad)} blocks checked, {n_bad} bad, {len(orphans)} orphans"
              + (" (blocks whose parent was removed, by a clear or an eviction, while they were written: never "
                 "served, no damage; --repair removes them)" if orphans and not repair else ""))
    raise typer.Exit(1 if n_bad else 0)


def _checked(disk, cat: Catalog) -> tuple[dict[bytes, str], list[bytes]]:
    """Every block's check (key -> why it is bad, orphans included) and the orphans among them."""
    from rich.progress import track

    bad: dict[bytes, str] = {}
    with disk.reader() as txn:
        for rec in track(list(cat.records.values()), description="verifying", console=err, transient=True):
            why = check_block(disk, txn, rec)
            if why:
                bad[rec.key] = why
    for key in cat.bad:
        bad[key] = "index record unreadable"
    orphans: list[bytes] = []
    for key in cat.orphans():
        if key in bad:
            continue
        if cat.records[key].parent in bad:  # its parent's record is damaged: part of that damage
            bad[key] = "parent block's index record unreadable"
        else:
            orphans.append(key)
            bad[key] = "parent block missing (orphan)"
    return bad, orphans


app.command("export")(export_)  # (kvstore/admin/cli_transfer.py)
app.command("import")(import_)
app.command("explain")(explain_)  # (kvstore/admin/cli_explain.py)


@app.command()
def clear(
    path: Optional[Path] = OptionalPathArg,
    model: Optional[str] = typer.Option(None, help="Only blocks of models whose name or root key starts with this."),
    older_than: Optional[str] = typer.Option(None, help="Only blocks unused for this long: 90s, 30m, 12h, 7d, 2w."),
    all_: bool = flag("--all", help="Everything (needed when no filter is given)."),
    yes: bool = flag("--yes", "-y", help="Do not ask before deleting."),
    remote: Optional[str] = RemoteOpt, namespace: Optional[str] = NamespaceOpt,
):
    """Remove entries from a store, or with --remote from a shared Redis / Valkey tier. Asks first unless --yes.

    Example: [bold]kvstore clear ~/.cache/kvstore/store --older-than 7d --yes[/bold]
    or [bold]kvstore clear --remote redis://cache:6379/0 --model my-model --yes[/bold]
    """
    _path_or_remote(path, remote)
    if model is None and older_than is None and not all_:
        err.print("[red]error:[/red] say what to remove: --model, --older-than, or --all")
        raise typer.Exit(2)
    if remote is not None and older_than is not None:
        err.print("[red]error:[/red] --older-than acts on local stores only: the remote tier keeps no use times "
                  "(Redis evicts by its own LRU); use --model or --all with --remote")
        raise typer.Exit(2)
    try:
        age = parse_age(older_than) if older_than is not None else None
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    if path is not None:
        _clear_local(path, model, age, yes)
    if remote is not None:
        _clear_remote(remote, namespace, model, yes)


_DELETE_BATCH = 1024  # blocks per write transaction of `clear`


def _clear_local(path: Path, model: Optional[str], age: Optional[float], yes: bool) -> None:
    disk = _open(path, readonly=False)
    try:
        cat = Catalog.read(disk)
        keys = select(cat, model=model, older_than=age)
        nbytes = sum(cat.records[k].nbytes for k in keys if k in cat.records)
        if not keys:
            out.print("nothing matches")
            return
        _warn_users(disk)
        if not yes and not typer.confirm(f"Delete {len(keys)} blocks ({_size(nbytes)}) from {path}?", default=False):
            out.print("nothing deleted")
            raise typer.Exit(1)
        keys.sort(key=lambda k: -cat.records[k].start if k in cat.records else 0)  # later blocks first
        n = 0
        with Progress(*Progress.get_default_columns(), console=err, transient=True) as bar:
            task = bar.add_task("deleting", total=len(keys))
            for i in range(0, len(keys), _DELETE_BATCH):  # (one stopped part-way leaves servable prefixes)
                n += len(disk.remove(keys[i : i + _DELETE_BATCH], clearing=True))
                bar.advance(task, min(_DELETE_BATCH, len(keys) - i))
        out.print(f"deleted {n} blocks ({_size(nbytes)})")
    finally:
        disk.close()


def _warn_users(disk: LmdbTier) -> None:
    """Say which other processes have the store open: the clear is safe beside them (their next write learns of
    it and stores no block whose parent is gone), but they keep serving what they hold in RAM."""
    pids = other_processes(disk)
    if pids:
        err.print(f"[yellow]warning:[/yellow] {len(pids)} other process{'es' if len(pids) > 1 else ''} "
                  f"(pid {', '.join(map(str, pids))}) {'have' if len(pids) > 1 else 'has'} this store open: they "
                  f"keep serving the cleared prompts they hold in RAM until their next write to the store, which "
                  f"makes them forget what was cleared. Restart them for a clean slate.")


def main() -> None:
    """Run the commands. Every error ends as one line on stderr, exit code 2 (``kvstore.admin.exits``)."""
    run_app(app)


if __name__ == "__main__":
    main()
