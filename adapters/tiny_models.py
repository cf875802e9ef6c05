"""Tiny, fixed-seed mlx-lm models for tests and local experiments.

``make_tiny_model(kind, path, seed=0, **overrides)`` writes a complete model
folder in the usual mlx-lm / Hugging Face layout::

    config.json
    generation_config.json
    model.safetensors          (mlx "sanitized" layout, float16 by default)
    tokenizer.json             (byte-level BPE trained in-process)
    tokenizer_config.json      (bos/eos/pad + a ChatML-style chat_template)
    special_tokens_map.json
    tiny_model.json            (marker: generator version, kind, seed, config)

so that ``mlx_lm.load(path)`` returns a working ``(model, tokenizer)`` pair for
``mlx_lm.generate``, ``tokenizer.apply_chat_template`` and ``mlx_lm.server``.
Nothing is downloaded; everything is derived from the seed and the config, and
the same (kind, seed, overrides) always produce bit-identical files.
The tokenizer is made by :mod:`.tiny_tokenizer`, the weights by
:mod:`.tiny_weights`; this module holds the configs, writes the folders and is
the command line.

Kinds and the cache classes ``mlx_lm.models.cache.make_prompt_cache`` builds:

* ``llama``       -- 2 layers, every layer ``KVCache``.
* ``qwen3``       -- 2 layers, every layer ``KVCache`` (q/k-norm variant).
* ``gemma3_text`` -- 4 layers, sliding_window_pattern 2, sliding_window 64:
                     ``[RotatingKVCache(64), KVCache, RotatingKVCache(64), KVCache]``.
* ``qwen3_next``  -- 4 layers, full_attention_interval 2, dense MLP:
                     ``[ArraysCache(2), KVCache, ArraysCache(2), KVCache]``.

Any config key can be overridden (``num_hidden_layers=8``, ``sliding_window=128``,
``vocab_size=512``...; under 261, the byte-level BPE's floor, the tokenizer is
character-level: printable ASCII, tab, newline); ``dtype`` selects ``"float16"`` (default), ``"bfloat16"``
or ``"float32"`` weights (and so the KV-cache dtype).

Command line::

    python -m kvstore.adapters.tiny_models KIND [PATH] [--seed N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Tuple

from .tiny_tokenizer import BOS, EOS, IM_END, PAD, SPECIAL_TOKENS, build_tokenizer, tokenizer_files
from .tiny_weights import build_weights

__all__ = [
    "KINDS",
    "EXPECTED_CACHES",
    "make_tiny_model",
    "ensure_tiny_model",
    "default_model_dir",
    "model_config",
    "build_tokenizer",
    "main",
]

# Bump when anything that influences the written bytes changes (init rules,
# corpus, tokenizer recipe, config defaults): stale folders get rebuilt.
FORMAT_VERSION = 2
MARKER = "tiny_model.json"

# --------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------

_COMMON: Dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    # One query head and one KV head of 64: on mlx's CPU backend float16
    # attention is a naive matmul (~3 GFLOP/s), so q heads cost prefill time
    # linearly and buy nothing for KV-cache tests (the cache holds KV heads).
    # Use num_attention_heads=2, num_key_value_heads=2 for multi-head layouts.
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "dtype": "float16",
}

_CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
    },
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 4,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_next": {
        **_COMMON,
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "attention_bias": False,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        # Dense MLPs: mlx's CPU GatherMM (used by the MoE SwitchGLU) only
        # supports float32. num_experts=4 works with dtype="float32".
        "num_experts": 0,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
}

KINDS: Tuple[str, ...] = ("llama", "gemma3_text", "qwen3_next", "qwen3")

# Cache class names per layer for the default configs (see module docstring).
EXPECTED_CACHES: Dict[str, List[str]] = {
    "llama": ["KVCache"] * 2,
    "qwen3": ["KVCache"] * 2,
    "gemma3_text": ["RotatingKVCache", "KVCache"] * 2,
    "qwen3_next": ["ArraysCache", "KVCache"] * 2,
}

_DTYPES = ("float16", "bfloat16", "float32")

# --------------------------------------------------------------------------
# Folder handling
# --------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def model_config(kind: str, **overrides: Any) -> Dict[str, Any]:
    """The config.json content for ``kind`` with ``overrides`` applied."""
    if kind not in _CONFIGS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    config = copy.deepcopy(_CONFIGS[kind])
    overrides = dict(overrides)
    if "torch_dtype" in overrides:
        overrides.setdefault("dtype", overrides.pop("torch_dtype"))
    if "model_type" in overrides and overrides["model_type"] != config["model_type"]:
        raise ValueError("model_type cannot be overridden; pick another kind")
    config.update(overrides)
    if config["dtype"] not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {config['dtype']!r}")
    config["torch_dtype"] = config["dtype"]
    config["bos_token_id"] = SPECIAL_TOKENS.index(BOS)
    config["eos_token_id"] = SPECIAL_TOKENS.index(EOS)
    config["pad_token_id"] = SPECIAL_TOKENS.index(PAD)
    return config


def default_model_dir() -> pathlib.Path:
    """Where ``ensure_tiny_model`` keeps models: $KVSTORE_MODEL_DIR, else
    $XDG_CACHE_HOME/kvstore/models, else ~/.cache/kvstore/models."""
    env = os.environ.get("KVSTORE_MODEL_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "kvstore" / "models"


def _spec(kind: str, seed: int, config: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "generator": "kvstore.adapters.tiny_models",
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "seed": seed,
        "config": config,
    }


def _read_marker(path: pathlib.Path):
    try:
        with open(path / MARKER, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_complete(path: pathlib.Path, spec: Dict[str, Any]) -> bool:
    marker = _read_marker(path)
    if not marker or marker.get("spec") != json.loads(json.dumps(spec)):
        return False
    for fname, size in marker.get("files", {}).items():
        f = path / fname
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def _write_folder(dst: pathlib.Path, kind: str, seed: int, config: Dict[str, Any]) -> None:
    import mlx.core as mx

    tok_files, n_tokens, banned = tokenizer_files(config["vocab_size"], config["max_position_embeddings"])
    files = {name: v if isinstance(v, str) else _dumps(v) for name, v in tok_files.items()}
    files["config.json"] = _dumps(config)
    files["generation_config.json"] = _dumps(
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": [config["eos_token_id"], SPECIAL_TOKENS.index(IM_END)],
            "pad_token_id": config["pad_token_id"],
            "do_sample": False,
        }
    )
    for fname, text in files.items():
        (dst / fname).write_text(text, encoding="utf-8")
    weights = build_weights(config, seed, n_tokens, banned)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    sizes = {f.name: f.stat().st_size for f in sorted(dst.iterdir()) if f.is_file()}
    marker = {
        "spec": _spec(kind, seed, config),
        "files": sizes,
        "sha256": {
            name: hashlib.sha256((dst / name).read_bytes()).hexdigest() for name in sizes
        },
    }
    (dst / MARKER).write_text(_dumps(marker), encoding="utf-8")


def make_tiny_model(
    kind: str, path: "str | os.PathLike[str]", *, seed: int = 0, **overrides: Any
) -> pathlib.Path:
    """Write the model folder at ``path`` and return it.

    Idempotent: a complete folder made with the same kind, seed and config is
    returned untouched. A folder made by this function with different settings
    is replaced; an existing non-empty folder not made by it raises
    ``FileExistsError``. The folder is built in a temporary sibling directory
    and renamed into place, so concurrent callers never see a partial folder.
    """
    path = pathlib.Path(path)
    config = model_config(kind, **overrides)
    spec = _spec(kind, seed, config)
    if _is_complete(path, spec):
        return path
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and _read_marker(path) is None:
        raise FileExistsError(f"{path} is not empty and was not made by make_tiny_model")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _write_folder(tmp, kind, seed, config)
        for _ in range(3):
            try:
                os.rename(tmp, path)  # atomic; fails if path is a non-empty dir
                return path
            except OSError:
                if _is_complete(path, spec):  # someone else just built it
                    return path
                if path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
                elif _read_marker(path) is not None:  # stale tiny model: replace
                    trash = pathlib.Path(
                        tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent)
                    )
                    try:
                        os.rename(path, trash / "m")
                    except OSError:
                        pass
                    shutil.rmtree(trash, ignore_errors=True)
                else:
                    raise
        raise OSError(f"could not move the new model into {path}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_tiny_model(
    kind: str, *, seed: int = 0, root: "str | os.PathLike[str] | None" = None, **overrides: Any
) -> pathlib.Path:
    """Build (once) into ``root`` (default: ``default_model_dir()``) under a
    name derived from kind, seed and overrides, and return the folder."""
    config = model_config(kind, **overrides)
    digest = hashlib.sha256(
        json.dumps(_spec(kind, seed, config), sort_keys=True).encode()
    ).hexdigest()[:10]
    root = pathlib.Path(root) if root is not None else default_model_dir()
    return make_tiny_model(kind, root / f"{kind}-seed{seed}-{digest}", seed=seed, **overrides)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvstore.adapters.tiny_models",
        description="Write a tiny fixed-seed mlx-lm model folder.",
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument(
        "path",
        nargs="?",
        help="output folder (default: a folder under default_model_dir())",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, VALUE parsed as JSON if possible (repeatable)",
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _parse_value(value)
    if args.path:
        out = make_tiny_model(args.kind, args.path, seed=args.seed, **overrides)
    else:
        out = ensure_tiny_model(args.kind, seed=args.seed, **overrides)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
