"""What ``kvstore vllm-mlx serve`` and ``kvstore omlx serve`` share: the
store's options read from beside the engine's own (an engine option that
would take the prefix cache off the store is refused, naming the store's
option to use instead), and the engine's own server run until it shuts down,
then the store flushed and closed."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Callable, Mapping, Sequence

from .server_args import parse_kv_bits, store_args

__all__ = ["parse_store_options", "run_until_stopped"]

log = logging.getLogger("kvstore")


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    p.add_argument("--ssd-path", default=None)
    p.add_argument("--budget-gb", type=float, default=4.0)
    p.add_argument("--disk-budget-gb", type=float, default=None)
    p.add_argument("--kv-bits", default=None)
    p.add_argument("--store-group-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None)  # None: the store's own (256 for a new one)
    p.add_argument("--namespace", default=None)
    p.add_argument("--fetch-policy", default="auto", choices=["auto", "always", "never"])
    p.add_argument("--calibrate-budget-s", type=float, default=3.0)  # 0: no calibration of the model's prefill
    p.add_argument("--ssd-admit", default="always", choices=["always", "reuse"])
    p.add_argument("--remote", default=None)
    p.add_argument("--remote-timeout", type=float, default=0.5)
    p.add_argument("--remote-secret", default=None)  # better: $KVSTORE_REMOTE_SECRET (not in process lists)
    return p


def parse_store_options(prog: str, argv: Sequence[str], refused: Mapping[str, str]) -> tuple[dict, list[str]]:
    """The store's options in ``argv`` as ``PrefixStore`` arguments, and the
    rest for the engine's server. An option named in ``refused`` exits with
    code 2 and its reason (what to use instead)."""
    parser = _parser(prog)
    opts, rest = parser.parse_known_args(list(argv))
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name in refused:
            parser.error(f"{name} does not apply on the store: {refused[name]}")
    try:
        bits = parse_kv_bits(opts.kv_bits)
    except ValueError as e:
        parser.error(f"--kv-bits: {e}")
    return store_args(opts, opts.budget_gb, bits), rest


def run_until_stopped(main: Callable[[], object], argv: Sequence[str], *closers: Callable[[], object]) -> None:
    """``main()`` (an engine's command-line entry) with ``sys.argv = argv``
    until its server shuts down; SIGTERM or Ctrl-C end it too. Then each of
    ``closers`` runs, in order (the store's last: pending blocks written)."""
    def stop(signum, frame):
        # uvicorn shuts down on SIGTERM, then raises it again for the handler it found: ours ends main()
        raise KeyboardInterrupt

    argv0, previous = sys.argv, signal.signal(signal.SIGTERM, stop)
    sys.argv = list(argv)
    try:
        main()  # returns (or raises KeyboardInterrupt) once uvicorn has shut down
    except KeyboardInterrupt:
        pass
    finally:
        sys.argv = argv0
        signal.signal(signal.SIGTERM, previous)
        for close in closers:
            close()
        log.info("kvstore: store closed, pending blocks written")
