"""What a model is, by content: the store keys mlx-lm models (and their
adapters) by these digests, never by a name or a path.

``model_fingerprint`` hashes a model folder's files (each file's digest is
remembered per file identity: see ``file_digests``); ``loaded_model_fingerprint``
hashes a loaded model in memory; ``adapter_fingerprint`` an mlx-lm adapter
folder. A model's cache layout (``cache_layout``: each cache slot's class and
parameters) is part of its fingerprint: the same weights under another cache
layout must not share entries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models import cache as C

from .cache_classes import describe
from .file_digests import file_digests

__all__ = [
    "cache_layout", "layout_signature", "model_fingerprint", "loaded_model_fingerprint", "adapter_fingerprint",
    "ADAPTER_FILES",
]


def cache_layout(prompt_cache_or_model: Union[Sequence[Any], nn.Module]) -> list[str]:
    """One descriptor per top-level cache slot, nesting spelled out.

    Accepts a prompt cache (the list ``make_prompt_cache`` returns) or a model
    (whose fresh ``make_prompt_cache(model)`` is described). Goes into the model
    fingerprint so one store never mixes entries of different layouts, e.g.
    ``['Rotating(max_size=512,keep=0)', 'KV', 'CacheList(Arrays(2),KV)']``.
    """
    if isinstance(prompt_cache_or_model, nn.Module):
        prompt_cache_or_model = C.make_prompt_cache(prompt_cache_or_model)
    return [describe(c) for c in prompt_cache_or_model]


def layout_signature(prompt_cache_or_model: Union[Sequence[Any], nn.Module]) -> str:
    """:func:`cache_layout` as one string (``;``-joined)."""
    return ";".join(cache_layout(prompt_cache_or_model))


_FP_TAG = b"kvstore-mlx-lm-fingerprint-v2"
# what transformers' AutoTokenizer reads that maps text to ids
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt")


def hash_field(h: "xxhash.xxh3_128", name: str, data: bytes) -> None:
    """Length-prefixed, named field: no two field sequences hash the same."""
    tag = name.encode()
    h.update(len(tag).to_bytes(4, "little") + tag + len(data).to_bytes(8, "little"))
    h.update(data)


def _canonical_json(path: Path) -> bytes:
    """A JSON file's content without its formatting and key order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def model_fingerprint(
    model_path: Union[str, os.PathLike],
    prompt_cache_or_model: Union[Sequence[Any], nn.Module, None] = None,
    extra: str = "",
) -> str:
    """What the model *is* (not what it is called), as an xxh3-128 hex digest.

    Hashes the canonical JSON of ``config.json``, the whole content of the
    tokenizer files present and of every ``*.safetensors`` file (each file's
    digest is remembered per file identity: see ``file_digests``), the cache
    layout of ``prompt_cache_or_model`` when given (pass it: the same weights
    under another cache layout, e.g. ``max_kv_size``, must not share entries),
    and ``extra`` (e.g. an adapter's fingerprint or a dtype override the caller
    applies). Only explicit bytes are hashed, so the value is the same in every process.
    """
    root = Path(model_path)
    h = xxhash.xxh3_128()
    h.update(_FP_TAG)
    hash_field(h, "config.json", _canonical_json(root / "config.json"))
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weight files in {root}")
    names = [n for n in _TOKENIZER_FILES if (root / n).is_file()]
    for name, digest in zip(names + ["weights:" + p.name for p in weights],
                            file_digests([root / n for n in names] + weights)):
        hash_field(h, name, digest)
    if prompt_cache_or_model is not None:
        hash_field(h, "layout", layout_signature(prompt_cache_or_model).encode())
    hash_field(h, "extra", extra.encode("utf-8"))
    return h.hexdigest()


def loaded_model_fingerprint(model: nn.Module, extra: str = "") -> str:
    """What a loaded model computes with: its config, every module's kind and
    scalar settings (a LoRA layer's scale, a norm's eps), every parameter's
    name, shape, dtype and all its bytes (an adapter's too), and its cache
    layout. Hashed in memory (docs/benchmarks.md, fingerprint cost)."""
    h = xxhash.xxh3_128(b"kvstore-loaded-model-v2")
    args = getattr(model, "args", None)
    h.update(json.dumps(getattr(args, "__dict__", {}) or {}, sort_keys=True, default=str).encode())
    for name, module in model.named_modules():
        settings = {k: v for k, v in vars(module).items()
                    if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}
        h.update(f"{name}:{type(module).__name__}:{sorted(settings.items())}".encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{p.shape}:{p.dtype}".encode())
        h.update(memoryview(p.view(mx.uint16) if p.dtype == mx.bfloat16 else p).cast("B"))
    h.update(layout_signature(model).encode())
    h.update(extra.encode())
    return h.hexdigest()


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")  # what mlx-lm's load_adapters reads


def adapter_fingerprint(adapter_path: Union[str, os.PathLike]) -> str:
    """What an mlx-lm adapter folder holds, by content: the canonical JSON of
    ``adapter_config.json`` (layers, rank, scale, kind) and every byte of
    ``adapters.safetensors``, never its path (an adapter retrained in place
    keeps its path)."""
    root = Path(adapter_path)
    h = xxhash.xxh3_128(b"kvstore-mlx-lm-adapter-v1")
    hash_field(h, ADAPTER_FILES[0], _canonical_json(root / ADAPTER_FILES[0]))
    hash_field(h, ADAPTER_FILES[1], file_digests([root / ADAPTER_FILES[1]])[0])
    return h.hexdigest()
