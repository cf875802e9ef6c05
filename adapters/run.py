"""``kvstore run [store options] -- COMMAND ...``: any Python engine built on
mlx-lm, on the store, without a change to its code.

How: ``kvstore run`` checks the store options, that COMMAND is there and
that the store opens (an engine would learn of a bad ``--ssd-path`` only at
its first request, after loading its model), puts the options in
``$KVSTORE_RUN_STORE`` (JSON), prepends ``run_boot/`` to ``$PYTHONPATH`` and
replaces itself with COMMAND (``os.execvpe``: the exit status and signals are
the engine's own). Python runs ``run_boot/sitecustomize.py`` at start-up in
that process and in every Python process it starts; it calls
:func:`install_hook`, which only adds an import hook (nothing is imported).
When the engine imports ``mlx_lm.generate`` (directly, through ``mlx_lm`` or
through ``from mlx_lm.generate import stream_generate``), the hook patches
the module right after it runs and before the import returns, so every name
an engine or mlx-lm's own modules take from it is already the instrumented
one, and its ``BatchGenerator`` class is instrumented in place
(:mod:`kvstore.adapters.run_patch`). The store opens on the first
request. A ``sitecustomize`` that ours shadows (a distribution's) still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Sequence

BOOT = Path(__file__).with_name("run_boot")
_TARGET = "mlx_lm.generate"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def patch(module) -> None:
    """Instrument a loaded ``mlx_lm.generate`` (once)."""
    from .run_patch import instrument, instrument_batch

    if getattr(module.generate_step, "__wrapped__", None) is None:
        module.generate_step = instrument(module.generate_step)
    instrument_batch(module)  # (once: it knows its own wrappers)


def install_hook() -> None:
    """Patch ``mlx_lm.generate`` when it is imported (now, if it already is)."""
    if _TARGET in sys.modules:
        patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def parse_run_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """``kvstore run``'s store options (``kvstore serve``'s) as ``PrefixStore``
    arguments, and the command after them (a ``--`` before it is optional)."""
    import argparse

    from kvstore.config import store_config

    from .server_args import parse_args, store_parser

    parser = store_parser("kvstore run", "kvstore run [store options] -- COMMAND ...")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    argv = list(argv)
    command = parser.parse_args(argv).command  # an unknown option before the command exits here
    store_args, rest = parse_args(argv[: len(argv) - len(command)])
    if rest:
        parser.error(f"{' '.join(rest)}: not a store option (mlx-lm's own options go to the engine's command)")
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        parser.error("no command to run: kvstore run [store options] -- COMMAND ...")
    store_config(**store_args)  # a bad store option is an error here, not in the engine
    return store_args, command


def exec_engine(store_args: dict, command: Sequence[str]) -> None:
    """Replace this process by ``command``, instrumented, on a store of ``store_args``; a command
    that is not there or a store that cannot open is a ``KVStoreError`` before anything runs."""
    from kvstore import PrefixStore
    from kvstore.config import store_config
    from kvstore.errors import ConfigError

    env = dict(os.environ)
    if shutil.which(command[0], path=env.get("PATH", os.defpath)) is None:
        raise ConfigError(f"{command[0]}: no such command" + ("" if os.sep in command[0] else " on $PATH")
                          + (" (not executable)" if os.path.isfile(command[0]) else "") + "; nothing was run")
    PrefixStore(store_config(**store_args)).close()  # (StoreOpenError: the path is no store, or unwritable)
    env["KVSTORE_RUN_STORE"] = json.dumps({k: v for k, v in store_args.items() if v is not None})
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as e:  # (found, but the system would not start it: a bad interpreter line, ...)
        raise ConfigError(f"{command[0]}: cannot run it ({e.strerror}); nothing was run") from None
