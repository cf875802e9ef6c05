"""``kvstore serve``'s command line: the store's options beside all of
``mlx_lm.server``'s (``--prompt-cache-bytes`` is the store's RAM budget,
``--prompt-cache-size`` is refused), read into ``PrefixStore`` arguments."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, Union

__all__ = ["parse_args", "parse_kv_bits", "store_args", "store_parser", "usage"]

GB = 1 << 30  # PrefixStore's budget unit

_SIZE_REFUSED = ("--prompt-cache-size counts cached sequences; the store is bounded by bytes instead: "
                 "use --budget-gb (RAM) or --prompt-cache-bytes, and --disk-budget-gb (SSD)")


def store_parser(prog: str = "kvstore serve",
            usage: str = "kvstore serve --model PATH [store options] [mlx_lm.server options]") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False, usage=usage)
    g = p.add_argument_group("the store's options")
    g.add_argument("--ssd-path", default=None, metavar="DIR",
                   help="the store's directory on SSD (kept across restarts); without it the store is RAM-only")
    g.add_argument("--budget-gb", type=float, default=None, help="RAM budget of the store in GiB (default 4)")
    g.add_argument("--disk-budget-gb", type=float, default=None,
                   help="SSD budget in GiB (default: half the free space, at most 64)")
    g.add_argument("--store-kv-bits", default=None,
                   help="bits of stored entries: 8, 4, or K,V like 8,4 (default: as the engine holds them)")
    g.add_argument("--store-group-size", type=int, default=64, help="quantization group size (default 64)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per stored block of a new store (default 256; a store keeps the one it was made with)")
    g.add_argument("--namespace", default=None, help="a tenant: stores of other namespaces share nothing")
    g.add_argument("--fetch-policy", default="auto", choices=["auto", "always", "never"],
                   help="auto: load a hit only where that beats recomputing it (rates measured here)")
    g.add_argument("--ssd-admit", default="always", choices=["always", "reuse"],
                   help="always: write every block to SSD; reuse: only blocks asked for again (fewer SSD writes)")
    g.add_argument("--calibrate-budget-s", type=float, default=3.0,
                   help="auto: seconds a model's first request may spend timing its prefill (default 3; 0: none)")
    g.add_argument("--remote", default=None,
                   help="a Redis / Valkey server or cluster shared by hosts: redis://[:password@]host:port/db, "
                        "rediss://..., unix:///path.sock (password also from $KVSTORE_REMOTE_PASSWORD)")
    g.add_argument("--remote-timeout", type=float, default=0.5, help="seconds per remote call (default 0.5)")
    g.add_argument("--remote-secret", default=None,
                   help="sign remote blocks and serve only signed ones (better: $KVSTORE_REMOTE_SECRET, which stays "
                        "out of process lists)")
    # mlx-lm's own cache options, mapped onto the store or refused
    g.add_argument("--prompt-cache-bytes", default=None,
                   help="mlx-lm's option: here the store's RAM budget (instead of --budget-gb), e.g. 4GB")
    g.add_argument("--prompt-cache-size", default=None, help=argparse.SUPPRESS)
    return p


def usage() -> str:
    """``kvstore serve --help``: the store's options, then mlx-lm's server
    options less the one refused here (``--prompt-cache-size``)."""
    import contextlib
    import io

    import mlx_lm.server as S

    buf, argv0 = io.StringIO(), sys.argv
    sys.argv = ["mlx_lm.server", "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            S.main()
    except SystemExit:
        pass
    finally:
        sys.argv = argv0
    text = buf.getvalue()
    theirs, skipping = [], False
    for line in text[text.find("\n\n") + 2:].splitlines():  # (after mlx-lm's usage lines)
        if line.startswith("  -"):
            skipping = line.lstrip().startswith("--prompt-cache-size")
        elif not line.startswith("   "):
            skipping = False
        if not skipping:
            theirs.append(line)
    return (store_parser().format_help() + "\nmlx_lm.server's options (all work here, but --prompt-cache-size: "
            + _SIZE_REFUSED + "):\n" + "\n".join(theirs))


def parse_kv_bits(text: Optional[str]) -> Union[None, int, tuple[int, int]]:
    """A command line's stored-entry bits: ``8``, or ``K,V`` like ``8,4``
    (``PrefixStore``'s ``kv_bits``); ``None`` for none given."""
    if not text:
        return None
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ValueError(f"{text!r} is not bits (8, 4, or K,V like 8,4)")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """``kvstore serve``'s own options as ``PrefixStore`` arguments, and the
    rest for mlx-lm's server. mlx-lm's ``--prompt-cache-bytes`` is the RAM
    budget (and stays with mlx-lm, which keeps running requests' caches
    within it too); ``--prompt-cache-size`` is refused (exit code 2)."""
    parser = store_parser()
    opts, rest = parser.parse_known_args(list(argv))
    if opts.prompt_cache_size is not None:
        parser.error(_SIZE_REFUSED)
    budget_gb = 4.0 if opts.budget_gb is None else opts.budget_gb
    if opts.prompt_cache_bytes is not None:
        if opts.budget_gb is not None:
            parser.error("--prompt-cache-bytes and --budget-gb both set the store's RAM budget: give one")
        from mlx_lm.utils import _parse_size  # the parser mlx-lm reads this option with

        try:
            budget_gb = _parse_size(opts.prompt_cache_bytes) / GB
        except Exception:
            parser.error(f"--prompt-cache-bytes: {opts.prompt_cache_bytes!r} is not a size (e.g. 512M, 4GB)")
        rest += ["--prompt-cache-bytes", opts.prompt_cache_bytes]
    try:
        bits = parse_kv_bits(opts.store_kv_bits)
    except ValueError as e:
        parser.error(f"--store-kv-bits: {e}")
    return store_args(opts, budget_gb, bits), _log_level_upper(rest)


def _log_level_upper(rest: list[str]) -> list[str]:
    """mlx-lm's ``--log-level`` takes DEBUG, INFO, ... only: ``--log-level debug`` (each request's
    served and not-served tokens, ``request_log``) reads as DEBUG too."""
    out = list(rest)
    for i, arg in enumerate(out):
        if arg == "--log-level" and i + 1 < len(out):
            out[i + 1] = out[i + 1].upper()
        elif arg.startswith("--log-level="):
            out[i] = arg.upper().replace("--LOG-LEVEL=", "--log-level=")
    return out


def store_args(opts: argparse.Namespace, budget_gb: float, bits: Union[None, int, tuple[int, int]]) -> dict:
    """A command line's store options (``kvstore serve``'s, or the engine servers' of ``engine_serve``) as
    ``PrefixStore`` arguments, the RAM budget and entry bits as read."""
    return dict(budget_gb=budget_gb, ssd_path=opts.ssd_path, block_size=opts.block_size, kv_bits=bits,
                kv_group_size=opts.store_group_size, namespace=opts.namespace, disk_budget_gb=opts.disk_budget_gb,
                fetch_policy=opts.fetch_policy, remote=opts.remote, remote_timeout=opts.remote_timeout,
                remote_secret=opts.remote_secret, calibrate_budget_s=opts.calibrate_budget_s, ssd_admit=opts.ssd_admit)
