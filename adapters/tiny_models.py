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
import random
import shutil
import sys
import tempfile
import zlib
from typing import Any, Dict, List, Tuple

import numpy as np

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
# Tokenizer
# --------------------------------------------------------------------------

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The library keeps a tiered cache of attention keys and values so that a prompt
which shares a prefix with an earlier prompt does not have to be processed
again. Blocks of tokens are hashed, and each block points to its parent, so a
lookup walks the chain from the first block until it finds a miss.
Memory is fast but small, the local disk is larger but slower, and a remote
store can hold almost everything while adding network latency to every fetch.
When the engine runs out of room it evicts the least recently used blocks,
writes them to the next tier, and frees the space for the request at hand.

Once upon a time there was a small village at the edge of a great forest. In
the village lived a baker who woke every morning before the sun to light her
oven. She made bread from flour, water, salt and a little yeast, and the smell
of the warm loaves drifted down the narrow streets and through the open
windows. Children ran to the shop with coins in their pockets, and the old
men sat on the bench outside, talking about the weather and the harvest.

One winter the snow fell for seven days without stopping. The roads were
closed, the river froze, and nobody could reach the market in the town across
the hills. The baker counted her sacks of flour and decided to share what she
had. Every family received one loaf each day, and in return they brought wood
for the oven, milk from their goats, or apples from their cellars.

Computers store numbers as bits. A floating point number has a sign, an
exponent and a mantissa; half precision uses sixteen bits, single precision
uses thirty two, and double precision uses sixty four. Matrix multiplication
is the heart of a neural network: the weights of each layer are multiplied
with the activations, a nonlinear function is applied, and the result is
passed to the next layer. Attention compares every query with every key,
turns the scores into probabilities with a softmax, and mixes the values.

The weather today will be cloudy in the morning with a chance of light rain
in the afternoon. Temperatures will reach eighteen degrees, and the wind will
blow from the west at twenty kilometers per hour. Tomorrow should be sunny
and warm, a good day for a walk in the park or a trip to the beach.

To make a cup of tea, boil fresh water, warm the pot, add one spoon of leaves
for each person and one for the pot, pour the water and wait three to five
minutes. Some people like milk and sugar, others prefer lemon or honey, and a
few drink it plain. Coffee is different: the beans are roasted, ground and
brewed, and the strength depends on the grind and the time.

Question: What is the capital of France? Answer: The capital of France is
Paris. Question: How many days are in a week? Answer: There are seven days in
a week. Question: Why is the sky blue? Answer: Sunlight is scattered by the
air, and blue light is scattered more than red light.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for i in range(10):
    print(i, fibonacci(i))

The quick brown fox jumps over the lazy dog. Pack my box with five dozen
liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz,
judge my vow. 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42.
"""

_WORDS = {
    "det": ["the", "a", "every", "one", "this", "that", "some", "each"],
    "adj": [
        "small", "large", "quiet", "bright", "old", "new", "red", "green",
        "fast", "slow", "happy", "careful", "strange", "simple", "heavy",
        "gentle", "clever", "distant", "warm", "cold", "busy", "empty",
    ],
    "noun": [
        "cat", "dog", "river", "mountain", "city", "garden", "teacher",
        "student", "engine", "server", "model", "window", "table", "friend",
        "market", "letter", "bridge", "forest", "cloud", "machine", "kitchen",
        "library", "station", "planet", "song", "story", "number", "memory",
        "request", "token", "layer", "block", "cache", "question", "answer",
    ],
    "verb": [
        "sees", "finds", "builds", "opens", "writes", "reads", "moves",
        "watches", "follows", "carries", "remembers", "visits", "paints",
        "answers", "stores", "loads", "computes", "shares", "holds", "keeps",
    ],
    "adv": [
        "slowly", "quickly", "quietly", "again", "today", "often", "never",
        "always", "carefully", "later", "together", "early", "almost",
    ],
    "prep": ["near", "under", "behind", "inside", "across", "beside", "after", "before"],
}


def _corpus_lines(n_generated: int = 1500) -> List[str]:
    """The embedded text plus deterministic generated sentences."""
    rng = random.Random(20240611)
    w = _WORDS
    lines = [line for line in _CORPUS.splitlines()]
    for i in range(n_generated):
        s = (
            f"{rng.choice(w['det'])} {rng.choice(w['adj'])} {rng.choice(w['noun'])} "
            f"{rng.choice(w['verb'])} {rng.choice(w['det'])} {rng.choice(w['noun'])} "
            f"{rng.choice(w['prep'])} {rng.choice(w['det'])} {rng.choice(w['adj'])} "
            f"{rng.choice(w['noun'])} {rng.choice(w['adv'])}"
        )
        s = s[0].upper() + s[1:]
        s += rng.choice([".", ".", ".", "!", "?", ", and then", ";"])
        if i % 7 == 0:
            s += f" {rng.randrange(1000)}"
        lines.append(s)
    return lines


def _bpe_train(lines: List[str], n_merges: int, alphabet: List[str]) -> List[Tuple[str, str]]:
    """Plain, deterministic byte-level BPE training (ties broken lexically).

    Implemented here rather than with ``tokenizers.trainers.BpeTrainer`` so the
    result cannot depend on the tokenizers version or hash-map iteration order.
    """
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    counts: Dict[str, int] = {}
    for line in lines:
        for piece, _ in pre.pre_tokenize_str(line + "\n"):
            counts[piece] = counts.get(piece, 0) + 1
    words = [(list(word), c) for word, c in sorted(counts.items())]
    known = set(alphabet)
    merges: List[Tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Dict[Tuple[str, str], int] = {}
        for syms, c in words:
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        a, b = best
        new = a + b
        merges.append(best)
        known.add(new)
        for syms, _ in words:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == a and syms[i + 1] == b:
                    syms[i : i + 2] = [new]
                i += 1
    return merges


def _byte_decoder() -> Dict[str, int]:
    """GPT-2 byte-level symbol -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_TOKENIZER_CACHE: Dict[int, Tuple[str, int, List[int]]] = {}


def build_tokenizer(vocab_size: int) -> Tuple[str, int, List[int]]:
    """Return (tokenizer.json text, number of tokens, unprintable ids) for a
    byte-level BPE.

    Ids 0..4 are the special tokens, then the 256 byte symbols, then merges.
    The tokenizer has at most ``vocab_size`` tokens (fewer only if the corpus
    runs out of merges; the model's extra rows are then never predicted).
    The unprintable ids are the special tokens and every token with a byte
    outside printable ASCII / tab / newline: the model never predicts them,
    so generations are EOS-free, valid UTF-8 and re-encode-stable in text.
    """
    if vocab_size in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[vocab_size]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    n_base = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size < n_base:
        result = _char_tokenizer(vocab_size)
        _TOKENIZER_CACHE[vocab_size] = result
        return result
    merges = _bpe_train(_corpus_lines(), vocab_size - n_base, alphabet)
    vocab: Dict[str, int] = {}
    for tok in SPECIAL_TOKENS + alphabet + [a + b for a, b in merges]:
        if tok not in vocab:
            vocab[tok] = len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos_id = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    text = tok.to_str(pretty=True)
    byte_of = _byte_decoder()
    ok = set(range(0x20, 0x7F)) | {0x09, 0x0A}
    banned = sorted(
        i
        for t, i in vocab.items()
        if t in SPECIAL_TOKENS or any(byte_of[ch] not in ok for ch in t)
    )
    result = (text, tok.get_vocab_size(with_added_tokens=True), banned)
    _TOKENIZER_CACHE[vocab_size] = result
    return result


# printable ASCII, tab and newline: a character-level tokenizer of these and
# the special tokens is the smallest one that still writes English text
_CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n"]


def _char_tokenizer(vocab_size: int) -> Tuple[str, int, List[int]]:
    """A character-level tokenizer (one token per printable ASCII character,
    tab and newline; other characters are dropped) for a vocabulary smaller
    than a byte-level one: ``vocab_size=105`` makes a model whose embedding
    is read past its end by any id of 105 or more."""
    from tokenizers import Tokenizer, decoders, models, processors

    n = len(SPECIAL_TOKENS) + len(_CHARS)
    if vocab_size < n:
        raise ValueError(f"vocab_size must be >= {n} (special tokens, printable ASCII, tab, newline)")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + _CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    return tok.to_str(pretty=True), n, list(range(len(SPECIAL_TOKENS)))


def _tokenizer_files(vocab_size: int, model_max_length: int) -> Dict[str, str]:
    tok_json, n_tokens, banned = build_tokenizer(vocab_size)
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tok_config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    return {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": _dumps(tok_config),
        "special_tokens_map.json": _dumps(special_map),
        "_n_tokens": str(n_tokens),
        "_banned": json.dumps(banned),
    }


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


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


def _build_weights(
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

    files = _tokenizer_files(config["vocab_size"], config["max_position_embeddings"])
    n_tokens = int(files.pop("_n_tokens"))
    banned = json.loads(files.pop("_banned"))
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
    weights = _build_weights(config, seed, n_tokens, banned)
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
