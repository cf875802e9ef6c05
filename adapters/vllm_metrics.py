"""The store's ``kvstore_*`` series in vllm-mlx's ``/metrics`` (``kvstore
vllm-mlx serve ... --enable-metrics``).

vllm-mlx keeps its Prometheus registry in one module-level collector
(``vllm_mlx.metrics.metrics``), made when ``--enable-metrics`` configures it
(``_init_prometheus``). ``add_store_metrics`` registers the store's collector
(``metrics.StoreCollector``: the series ``kvstore serve`` answers) in that
registry, now if it exists, else right after vllm-mlx makes it; without
``--enable-metrics`` nothing is made and nothing changes. What it relies on is
checked first: ``VllmMlxUnsupported`` names what is missing.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from kvstore import PrefixStore

from .metrics import StoreCollector
from .vllm_mlx import VllmMlxUnsupported


def _collector() -> Any:
    """vllm-mlx's metrics collector, once it is known to keep its registry where this module looks."""
    try:
        from vllm_mlx.metrics import metrics
    except ImportError as e:
        raise VllmMlxUnsupported(f"vllm_mlx.metrics does not import ({e}): the store's metrics cannot be added") from e
    init = getattr(type(metrics), "_init_prometheus", None)
    if init is None or not hasattr(metrics, "_prom") or '"registry"' not in inspect.getsource(init):
        raise VllmMlxUnsupported("vllm_mlx.metrics no longer keeps its registry in metrics._prom['registry'] "
                                 "(made by _init_prometheus): the store's metrics cannot be added")
    return metrics


def add_store_metrics(store: PrefixStore) -> Callable[[], None]:
    """Serve ``store``'s ``kvstore_*`` series in vllm-mlx's ``/metrics``; returns the undo."""
    metrics = _collector()
    ours = StoreCollector(store)
    done: list[Any] = []  # the registry ours is in

    def register() -> None:
        if metrics._prom is not None and not done:
            registry = metrics._prom["registry"]
            registry.register(ours)
            done.append(registry)

    own = metrics.__dict__.get("_init_prometheus")  # an earlier store's wrapper, else None: vllm-mlx's own
    made = metrics._init_prometheus

    def init_then_register() -> None:
        made()
        register()

    metrics._init_prometheus = init_then_register
    register()

    def undo() -> None:
        if own is None:
            metrics.__dict__.pop("_init_prometheus", None)
        else:
            metrics._init_prometheus = own
        for registry in done:
            registry.unregister(ours)
        done.clear()

    return undo
