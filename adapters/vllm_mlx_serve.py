"""``kvstore vllm-mlx serve``: vllm-mlx's own server, continuous batching, on
a ``PrefixStore`` (its prefix cache replaced by :func:`.vllm_mlx.install`)."""

from __future__ import annotations

from typing import Sequence

from kvstore import PrefixStore
from kvstore.config import store_config

from .engine_serve import parse_store_options, run_until_stopped

__all__ = ["parse_serve_args", "serve"]


# vllm-mlx serve options that would take the prefix cache away from the store
# or set a second one beside it, with what to use instead
_REFUSED = {
    "--ssd-cache-dir": "the store has its own SSD tier: --ssd-path DIR",
    "--ssd-cache-max-gb": "the store's SSD tier is bounded by --disk-budget-gb",
    "--use-paged-cache": "the store replaces the memory-aware prefix cache; the paged cache would bypass it",
    "--no-memory-aware-cache": "the store replaces the memory-aware prefix cache",
    "--disable-prefix-cache": "serve with vllm-mlx serve directly to run without a prefix cache",
    "--cache-memory-mb": "the store's RAM budget is --budget-gb",
    "--cache-memory-percent": "the store's RAM budget is --budget-gb",
    "--kv-cache-quantization": "stored entries are quantized with --kv-bits B (8, 4, or K,V like 8,4)",
    "--kv-cache-quantization-bits": "stored entries are quantized with --kv-bits B",
    "--kv-cache-quantization-group-size": "the store's group size is --store-group-size",
    "--prefix-trie-cache-size": "the store is bounded by bytes: --budget-gb (RAM) and --disk-budget-gb (SSD)",
    "--prefix-trie-cache-memory-mb": "the store's RAM budget is --budget-gb",
}


def parse_serve_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """``kvstore vllm-mlx serve``'s own options as ``PrefixStore`` arguments,
    and the rest for ``vllm-mlx serve``: continuous batching added, unless
    ``--prefix-trie-cache`` asks for vllm-mlx's SimpleEngine. Options
    that would move the prefix cache off the store exit with code 2, naming
    what to use instead."""
    store_args, rest = parse_store_options("kvstore vllm-mlx serve", argv, _REFUSED)
    if "--continuous-batching" not in rest and "--prefix-trie-cache" not in rest:
        rest.append("--continuous-batching")
    return store_args, rest


def _report_cached_tokens() -> None:
    """vllm-mlx's app reports the store's hits in usage (``vllm_usage``)."""
    import vllm_mlx.server as vserver

    from . import vllm_usage
    from .internals import unsupported
    from .vllm_mlx import TESTED, VllmMlxUnsupported

    app = getattr(vserver, "app", None)
    if not callable(getattr(app, "add_middleware", None)):
        raise unsupported(VllmMlxUnsupported, "vllm-mlx", "vllm-mlx", TESTED)("no vllm_mlx.server.app to add middleware to")
    app.add_middleware(vllm_usage.UsageMiddleware)


def serve(argv: Sequence[str]) -> None:
    """``kvstore vllm-mlx serve MODEL [store options] [vllm-mlx serve options]``:
    vllm-mlx's own server, continuous batching, on a ``PrefixStore``. SIGTERM
    or Ctrl-C shuts the server down, then flushes and closes the store."""
    store_args, rest = parse_serve_args(argv)
    config = store_config(**store_args)  # a bad store option is an error now, before the engine's imports
    from .vllm_mlx import check_vllm_mlx, install

    check_vllm_mlx()  # before anything starts: an unsupported version exits here
    import vllm_mlx.cli as vcli

    vargs = vcli.create_parser().parse_args(["serve", *rest])  # vllm-mlx's own reading of its options
    _report_cached_tokens()
    store = PrefixStore(config)
    installed = install(store, model_path=vargs.model, max_kv_size=vargs.max_kv_size or None)
    from .vllm_metrics import add_store_metrics

    remove_metrics = add_store_metrics(store)  # kvstore_* series in /metrics (with --enable-metrics)

    run_until_stopped(vcli.main, ["vllm-mlx", "serve", *rest], remove_metrics, installed.close, store.close)
