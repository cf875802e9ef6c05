"""The remote half of ``kvstore stats`` and ``kvstore clear``: what a shared
Redis / Valkey tier holds, read and cleared from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import RemoteConfigError
from ..tiers.remote.tier import RemoteTier
from ..tiers.remote.url import RemoteURL
from .remote_catalog import RemoteCatalog
from .ui import err, out, size as _size


def print_remote_stats(r: dict) -> None:
    t = Table(title=f"{r['url']}{' (cluster, %d primaries)' % r['primaries'] if r['cluster'] else ''}")
    for c in ("model", "namespaces", "blocks", "bytes"):
        t.add_column(c, justify="right" if c in ("blocks", "bytes") else "left")
    for name, d in r["models"].items():
        t.add_row(name[:24], ",".join(d["namespaces"]), str(d["blocks"]), _size(d["bytes"]))
    out.print(t)
    limit = _size(r["maxmemory"]) if r["maxmemory"] else "no limit"
    out.print(f"remote: {r['blocks']} blocks, {_size(r['bytes'])} of block bytes; server memory "
              f"{_size(r['used_memory'])} of {limit}, policy {r['maxmemory_policy']}")
    for w in r["warnings"]:
        err.print(f"[yellow]warning:[/yellow] {w}")


def path_or_remote(path: Optional[Path], remote: Optional[str]) -> None:
    if path is None and remote is None:
        err.print("[red]error:[/red] give a store directory, --remote URL, or both")
        raise typer.Exit(2)


def remote_catalog(url: str, namespace: Optional[str]) -> RemoteCatalog:
    tier = _open_remote(url)
    try:
        return RemoteCatalog.read(tier, "*" if namespace is None else namespace)
    except Exception as e:
        err.print(f"[red]error:[/red] reading {tier.url.shown} failed: {e}")
        raise typer.Exit(2)
    finally:
        tier.close()


def _open_remote(url: str) -> RemoteTier:
    try:
        tier = RemoteTier(url, timeout=5.0, write_timeout=60.0)
        tier.connect()
        return tier
    except RemoteConfigError as e:
        err.print(f"[red]error:[/red] {e}")
    except Exception as e:
        err.print(f"[red]error:[/red] cannot reach {_shown(url)}: {e}")
    raise typer.Exit(2)


def _shown(url: str) -> str:
    try:
        return RemoteURL.parse(url).shown
    except RemoteConfigError:
        return "the remote"


def clear_remote(url: str, namespace: Optional[str], model: Optional[str], yes: bool) -> None:
    cat = remote_catalog(url, namespace)
    names = cat.select(model)
    if not names:
        out.print(f"{cat.url}: nothing matches")
        return
    chosen = set(names)
    nbytes = sum(size for name, _, _, size in cat.blocks if name in chosen)
    if not yes and not typer.confirm(f"Delete {len(names)} blocks ({_size(nbytes)}) from {cat.url}?", default=False):
        out.print("nothing deleted")
        raise typer.Exit(1)
    tier = _open_remote(url)
    try:
        n = tier.remove_names(names)
        tier.remove_names(tier.listings(cat.roots(names), "*" if namespace is None else namespace))
    finally:
        tier.close()
    out.print(f"{cat.url}: deleted {n} blocks ({_size(nbytes)})")
