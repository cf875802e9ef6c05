"""``kvstore omlx serve``: oMLX's own multi-model server (``omlx serve``) on a
``PrefixStore``. :func:`.omlx.install` runs before the server starts, so
every scheduler its engine pool builds, for any model it discovers, keeps its
prompts' KV in the store; each model is keyed by its loaded weights (the
pool loads models from ``--model-dir`` by itself)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from kvstore import PrefixStore
from kvstore.config import store_config

from .engine_serve import parse_store_options, run_until_stopped

__all__ = ["parse_serve_args", "serve"]

# omlx serve options that would take the prefix cache away from the store or bound a second one beside it
_REFUSED = {
    "--no-cache": "the store is the server's prefix cache here: run omlx serve itself for none",
    "--paged-ssd-cache-max-size": "the store's SSD tier is bounded by --disk-budget-gb (its directory: --ssd-path)",
    "--hot-cache-max-size": "the store's RAM budget is --budget-gb",
}


def parse_serve_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """``kvstore omlx serve``'s own options as ``PrefixStore`` arguments, and
    the rest for ``omlx serve``; oMLX's cache options exit with code 2,
    naming the store's option to use."""
    return parse_store_options("kvstore omlx serve", argv, _REFUSED)


def serve(argv: Sequence[str]) -> None:
    """``kvstore omlx serve [store options] [omlx serve options]``: SIGTERM or
    Ctrl-C shuts the server down, then flushes and closes the store and ends
    the process (exit status 0)."""
    store_args, rest = parse_serve_args(argv)
    config = store_config(**store_args)  # a bad store option is an error now, before the engine's imports
    from .omlx import check_omlx, install

    check_omlx()  # before anything starts: an unsupported version exits here
    import omlx.cli as ocli

    store = PrefixStore(config)
    installed = install(store)
    run_until_stopped(ocli.main, ["omlx", "serve", *rest], installed.close, store.close)
    # The store is written. oMLX's server leaves threads of its own behind (it ends by the signal), and tearing
    # the interpreter down under them aborted the process (std::terminate) 2 times in 4 after a clean shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
