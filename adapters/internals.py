"""What the engine adapters (vllm_mlx, omlx) check about the engines' internals they replace."""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Callable, Optional


def dist_version(name: str) -> str:
    """The installed version of the distribution ``name``, or ``"unknown"``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def signature_mismatch(cls: type, signatures: dict[str, tuple[str, ...]]) -> Optional[str]:
    """The first method of ``cls`` whose leading parameters are not the ones
    its caller passes positionally (``signatures``), said in words; None when all are."""
    for name, params in signatures.items():
        have = list(inspect.signature(getattr(cls, name)).parameters)
        if have[: len(params)] != list(params):
            return f"{cls.__name__}.{name} takes {have}, the adapter expects {list(params)}"
    return None


def unsupported(error: Callable[[str], Exception], label: str, dist: str, tested: tuple[str, ...],
                pip_options: str = "") -> Callable[[str], Exception]:
    """``fail(what)``: the one error an adapter raises when the engine
    (distribution ``dist``, called ``label``) is not installed, or the
    installed one lacks ``what``; either way it says how to install one that works."""
    version = dist_version(dist)
    install = f"pip install {pip_options}'{dist}=={tested[-1]}'"

    def fail(what: str) -> Exception:
        if version == "unknown":
            return error(f"{label} is not installed: kvstore's adapter runs on {dist} {', '.join(tested)} "
                         f"({install})")
        return error(f"{label} {version} is not supported by kvstore's adapter ({what}); it was built and tested "
                     f"on {dist} {', '.join(tested)}: install one of those ({install})")

    return fail


def scheduler_module(name: str, cache_name: str, fail: Callable[[str], Exception]) -> tuple[Any, str]:
    """The engine's scheduler module ``name`` and its ``Scheduler`` class's
    source, once the module imports and has ``Scheduler`` and ``cache_name``."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise fail(f"{name} does not import: {e}") from e
    if not hasattr(module, cache_name) or not hasattr(module, "Scheduler"):
        raise fail(f"{name} has no {cache_name} or Scheduler")
    try:
        return module, inspect.getsource(module.Scheduler)
    except (OSError, TypeError) as e:
        raise fail(f"the Scheduler's source cannot be read: {e}") from e


class Handle:
    """What ``install`` returns: ``caches`` (the store-backed caches built
    while installed), ``flush``/``close`` over them, and ``uninstall`` on
    leaving its ``with``."""

    def __init__(self) -> None:
        self.caches: list[Any] = []

    def uninstall(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        for c in self.caches:
            c.flush()

    def close(self) -> None:
        for c in self.caches:
            c.close()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()
