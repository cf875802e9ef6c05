"""The tiny models' weights: fixed-seed random initialisation with one
numpy stream per parameter, scaled so that greedy decoding wanders instead of
locking into one token. See :mod:`.tiny_models`.

Anything changed here that changes the written bytes bumps
``tiny_models.FORMAT_VERSION``.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List

import numpy as np

__all__ = ["build_weights", "QK_GAIN"]


def _param_rng(seed: int, name: str) -> np.random.Generator:
    # One independent stream per parameter: changing one shape does not
    # reshuffle the others.
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# Random-init attention with unit-scale q/k is close to uniform averaging and
# greedy decoding then tends to lock into one token. Sharpening the scores
# (x4: q and k each x2, via the projections or the q/k RMSNorm gains) makes
# 32-48 token greedy continuations wander (checked over seeds 0-2, 6 prompts).
QK_GAIN = 2.0


def _init_param(
    name: str, default: np.ndarray, config: Dict[str, Any], seed: int, qk_norm: bool = False
) -> np.ndarray:
    shape = default.shape
    rng = _param_rng(seed, name)
    hidden = config["hidden_size"]
    is_gemma = config["model_type"].startswith("gemma")
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):  # gated delta decay, as in Qwen3NextGatedDeltaNet
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if default.ndim == 1:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            gain = QK_GAIN - 1.0 if is_gemma else QK_GAIN
            return np.full(shape, gain, np.float32)
        if "norm" in name and leaf == "weight":
            # gemma's RMSNorm multiplies by (1 + w); the others by w.
            return np.zeros(shape, np.float32) if is_gemma else np.ones(shape, np.float32)
        if leaf == "bias":
            return np.zeros(shape, np.float32)
        return default.astype(np.float32)  # e.g. dt_bias (ones)
    if name.endswith("embed_tokens.weight"):
        # gemma scales embeddings by sqrt(hidden) on the way in; with its
        # post-norms a token signal ~3x the branch outputs gives greedy
        # decoding that wanders instead of locking into a repeated token.
        std = 3.0 * hidden**-0.5 if is_gemma else 1.0
    elif "conv1d" in name:  # (channels, kernel, 1) depthwise
        std = (shape[1] * shape[2]) ** -0.5
    else:  # Linear (out, in) or SwitchLinear (experts, out, in)
        std = shape[-1] ** -0.5
        if not qk_norm and name.endswith(("q_proj.weight", "k_proj.weight")):
            std *= QK_GAIN
    return (rng.standard_normal(shape) * std).astype(np.float32)


def build_weights(
    config: Dict[str, Any], seed: int, n_tokens: int, banned: List[int]
) -> Dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    dtype = getattr(mx, config["dtype"])
    params = sorted(tree_flatten(model.parameters()))
    qk_norm = any(name.endswith("q_norm.weight") for name, _ in params)
    weights = {}
    for name, p in params:
        arr = _init_param(name, np.array(p.astype(mx.float32)), config, seed, qk_norm)
        if name == "lm_head.weight" or (
            name.endswith("embed_tokens.weight") and config.get("tie_word_embeddings")
        ):
            # Never predict special tokens (EOS would cut generations short),
            # partial-UTF-8 / control-byte tokens, or ids the tokenizer does
            # not have: a zero row gives logit 0, far below the max over the
            # ~900 remaining random logits.
            arr[banned] = 0.0
            arr[n_tokens:] = 0.0
        weights[name] = mx.array(arr).astype(dtype)
    mx.eval(weights)
    return weights
