"""How a ``kvstore`` command ends on an error: one line on stderr and exit
code 2, whatever the command. The one place that turns kvstore's own errors,
the operating system's refusals (a path, a device, a command) and bad
command-line options into that line; anything else is a bug and keeps its
traceback."""

from __future__ import annotations

from typing import NoReturn

import sys

import typer
from rich.markup import escape

from ..errors import KVStoreError
from .ui import err

USAGE_EXIT = 2  # as click's and argparse's refusals of an option
# click's exceptions, wherever this typer takes click from (typer 0.29 carries its own copy)
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_NoArgsIsHelp = getattr(sys.modules[_ClickException.__module__], "NoArgsIsHelpError", ())


def fail(message: str, code: int = USAGE_EXIT) -> NoReturn:
    """Print ``error: message`` (whitespace folded to one line) and exit."""
    err.print("[red]error:[/red]", escape(" ".join(str(message).split())))
    raise SystemExit(code)


def os_message(e: OSError) -> str:
    """``path: reason`` of an operating system's refusal (``[Errno 28]``'s words, not its number)."""
    if e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}" + (f" (-> {e.filename2})" if e.filename2 is not None else "")
    return e.strerror or str(e)


def run_app(app: typer.Typer) -> NoReturn:
    """Run ``app`` and exit with its status; its errors end as one line (see the module docstring)."""
    try:
        rv = app(standalone_mode=False)
    except _NoArgsIsHelp as e:  # `kvstore` alone: its help, as before
        e.show()
        raise SystemExit(e.exit_code) from None
    except _ClickException as e:  # an unknown option, a value out of range, a missing argument
        hint = f" (`{e.ctx.command_path} --help` lists the options)" if getattr(e, "ctx", None) is not None else ""
        fail(e.format_message() + hint, e.exit_code)
    except typer.Abort:  # a confirmation answered with end of input or ^C
        fail("aborted: nothing was changed", 1)
    except KVStoreError as e:
        fail(str(e))
    except OSError as e:
        fail(os_message(e))
    raise SystemExit(rv if isinstance(rv, int) else 0)
