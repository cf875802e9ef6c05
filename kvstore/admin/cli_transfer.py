"""``kvstore export`` and ``kvstore import`` (``transfer``): a store's entries
to one file and into a store, signed with the secret in
``$KVSTORE_EXPORT_SECRET`` where asked (``--sign`` / ``--verify``; the
environment keeps it out of process lists)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.progress import DownloadColumn, Progress

from ..errors import TransferError
from .export_file import SECRET_ENV
from .transfer import export_store, import_store
from .ui import err, flag, out, size as _size

QuietOpt = flag("--quiet", "-q", help="No progress bar (there is none when stderr is not a terminal).")


@contextmanager
def _progress(what: str, quiet: bool):
    """A progress bar on stderr, fed ``(bytes done, bytes in all)``."""
    with Progress(*Progress.get_default_columns(), DownloadColumn(), console=err, transient=True,
                  disable=quiet or not err.is_terminal) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _secret(wanted: bool, flag: str) -> Optional[str]:
    if not wanted:
        return None
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise TransferError(f"{flag} takes the secret from ${SECRET_ENV}, which is not set (an option would show it "
                            f"in process lists)")
    return secret


def export_(
    path: Path = typer.Argument(..., help="The store directory (the ssd_path the engine used).", show_default=False),
    file: Path = typer.Argument(..., help="The export file to write (replaced once complete).", show_default=False),
    model_key: Optional[str] = typer.Option(None, "--model-key", help="Only this model's entries (the model key "
                                            "its engine stored them under, as `kvstore inspect` names it)."),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Only entries of this namespace."),
    sign: bool = flag("--sign", help=f"Sign every frame with the secret in ${SECRET_ENV} "
                              "(HMAC-SHA256): `kvstore import --verify` takes only files its holders wrote."),
    quiet: bool = QuietOpt,
):
    """Write a store's entries (tokens, records, KV blocks, a checksum per block) to one file, for
    `kvstore import` on another machine or later. Opens the store read-only: safe while an engine writes it.

    Example: [bold]kvstore export ~/.cache/kvstore/store cache.kvx --model-key my-model[/bold]
    """
    secret = _secret(sign, "--sign")
    with _progress("exporting", quiet) as bar:
        r = export_store(path, file, model_key, namespace, progress=bar, secret=secret)
    out.print(f"exported {r.blocks} blocks ({_size(r.nbytes)}) of {len(r.models)} model"
              f"{'' if len(r.models) == 1 else 's'} ({', '.join(r.models) or 'none matched'}) to {file}"
              + (", signed" if r.signed else "")
              + (f"; {r.skipped} damaged blocks (or removed meanwhile) left out with the blocks below them "
                 f"(`kvstore verify`)" if r.skipped else ""))


def import_(
    path: Path = typer.Argument(..., help="The store directory to add to (made when the path is new or empty).",
                                show_default=False),
    file: Path = typer.Argument(..., help="A file `kvstore export` wrote.", show_default=False),
    verify: bool = flag("--verify", help=f"Take the file only if every frame is signed under the "
                                f"secret in ${SECRET_ENV} (`kvstore export --sign`)."),
    quiet: bool = QuietOpt,
):
    """Add the entries of an export file to a store. The whole file is checked first (every block's
    checksum, key and tokens; with --verify its signatures): a damaged, truncated, foreign or unsigned file
    is refused and nothing is written. Blocks the store holds already are skipped. Safe beside running
    engines: they find the new blocks at their next lookup.

    Example: [bold]kvstore import ~/.cache/kvstore/store cache.kvx[/bold]
    """
    secret = _secret(verify, "--verify")
    with _progress("importing", quiet) as bar:
        r = import_store(path, file, progress=bar, secret=secret)
    out.print(f"imported {r.blocks} blocks ({_size(r.nbytes)}) of {', '.join(r.models) or 'no model'}; "
              f"{r.present} already there"
              + (f"; {r.skipped} not written: their parent was removed meanwhile (a `kvstore clear`)"
                 if r.skipped else "")
              + (f"; {r.evicted} least recently used blocks evicted to stay under the disk budget" if r.evicted else "")
              + ("; signed, verified" if r.verified else "; signed, not verified (--verify checks it)"
                 if r.signed else ""))
