"""Which files a loaded model came from, so every engine keys it the same way.

``kvstore generate`` and ``kvstore serve`` know the model folder they load and
key the model by its files' content (``fingerprints.model_fingerprint``). An
engine that loads the model itself (under ``kvstore run``, oMLX's engine pool,
vllm-mlx) hands the store only the model object. :func:`watch_loads` wraps
mlx-lm's ``load_model`` and ``load_adapters`` (module globals of
``mlx_lm.utils``, which ``mlx_lm.load`` and the engines call) so each model
they return carries the folder, the adapter folder and when the load began;
:func:`loaded_from` gives that back while it still describes the model: the
files unchanged since the load began (``changed_since``: a file written
during the load keys by the loaded bytes) and the model's structure (every
parameter's name, shape and dtype, every module's kind) what the load left,
so an engine that quantizes or patches the model after loading it is keyed by
what it holds. A load with ``model_config`` overrides or its own model classes
is not recorded: its files do not say what it computes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.nn as nn
import xxhash
from mlx.utils import tree_flatten

from .fingerprints import ADAPTER_FILES
from .file_digests import changed_since, settle

__all__ = ["Source", "watch_loads", "record", "loaded_from", "key_files", "describe"]

_ATTR = "_kvstore_source"


@dataclass(frozen=True)
class Source:
    folder: Path  # resolved model folder (or GGUF file)
    adapter: Optional[Path]  # resolved adapter folder, if one was applied at load
    started_ns: int  # when the load began: files changed since are not what the model holds
    structure: str  # ``structure(model)`` when the load returned
    adapter_ns: int = 0  # when the adapter's load began


def structure(model: nn.Module) -> str:
    """A digest of the model's modules' kinds and parameters' names, shapes
    and dtypes (no bytes: milliseconds for an 8B model)."""
    h = xxhash.xxh3_128()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__name__};".encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{p.shape}:{p.dtype};".encode())
    return h.hexdigest()


def key_files(folder: Optional[Path], adapter: Optional[Path]) -> list[Path]:
    """The files a model loaded from ``folder`` (a folder or GGUF file) with ``adapter`` is keyed by."""
    files = [] if folder is None else [folder] if folder.is_file() else [p for p in folder.iterdir() if p.is_file()]
    return files + ([Path(adapter, n) for n in ADAPTER_FILES] if adapter else [])


def record(model: nn.Module, folder, started_ns: int, adapter=None, adapter_ns: int = 0) -> None:
    """Say that ``model`` is what loading ``folder`` from ``started_ns`` on
    (and ``adapter`` from ``adapter_ns`` on) gave."""
    source = Source(Path(folder).resolve(), Path(adapter).resolve() if adapter else None, started_ns,
                    structure(model), adapter_ns)
    object.__setattr__(model, _ATTR, source)


def loaded_from(model: Any) -> Optional[Source]:
    """Where ``model`` was loaded from, or None when that is unknown or no
    longer what it holds (files written since the load began, or the model
    changed since: quantized, layers replaced)."""
    source = getattr(model, _ATTR, None) if isinstance(model, nn.Module) else None
    if source is None or not source.folder.exists():
        return None
    if changed_since(key_files(source.folder, None), source.started_ns) or \
            (source.adapter is not None and changed_since(key_files(None, source.adapter), source.adapter_ns)):
        return None
    return source if structure(model) == source.structure else None


def describe(folder: Path) -> dict:
    """What ``kvstore inspect`` shows of a model loaded from ``folder``: its path and name."""
    folder = Path(folder).resolve()
    return {"path": str(folder), "name": folder.name}


_NEUTRAL = {"quantize_activations": False}  # what mlx-lm's load reads as absent (its generate CLI passes it)


def _neutral(overrides: dict) -> bool:
    """Whether ``model_config`` overrides leave the model its files describe
    (each one a value mlx-lm's load reads as absent)."""
    return all(k in _NEUTRAL and v == _NEUTRAL[k] for k, v in overrides.items())


def _watch_load_model(load_model):
    @functools.wraps(load_model)
    def watched(model_path, *args, **kwargs):
        local = Path(model_path)
        if local.is_dir():
            settle(key_files(local, None))  # files written just now: keyed by content once they settle
        started = time.time_ns()
        model, config = load_model(model_path, *args, **kwargs)
        overrides = kwargs.get("model_config") or (args[2] if len(args) >= 3 else None) or {}
        own_classes = "get_model_classes" in kwargs or len(args) >= 4
        if not own_classes and _neutral(overrides) and local.is_dir() and isinstance(model, nn.Module):
            record(model, model_path, started)
        return model, config

    watched.kvstore_watches = load_model
    return watched


def _watch_load_adapters(load_adapters):
    @functools.wraps(load_adapters)
    def watched(model, adapter_path, *args, **kwargs):
        source = getattr(model, _ATTR, None)
        if source is not None and Path(adapter_path).is_dir():
            settle(key_files(None, Path(adapter_path)))
        started = time.time_ns()
        out = load_adapters(model, adapter_path, *args, **kwargs)
        if source is not None and isinstance(out, nn.Module):
            record(out, source.folder, source.started_ns, adapter_path, started)
        return out

    watched.kvstore_watches = load_adapters
    return watched


def watch_loads(utils: Any = None) -> None:
    """Wrap ``mlx_lm.utils.load_model`` and ``load_adapters`` (once) so the
    models they return say where they came from. Every later ``mlx_lm.load``
    records; a name taken from the module before this call does not."""
    if utils is None:
        import mlx_lm.utils as utils
    for name, wrap in (("load_model", _watch_load_model), ("load_adapters", _watch_load_adapters)):
        fn = getattr(utils, name, None)
        if fn is not None and getattr(fn, "kvstore_watches", None) is None:
            setattr(utils, name, wrap(fn))
