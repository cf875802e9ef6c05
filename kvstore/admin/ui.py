"""The consoles the store commands print to, how they show sizes, and their flags."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console

out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def flag(*names: str, help: str) -> Any:
    """An option that is on when named (``--json``), shown so in ``--help``: no value column."""
    return typer.Option(False, *names, metavar="", help=help)
