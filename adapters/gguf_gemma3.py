"""Load a Gemma 3 GGUF file as mlx-lm's ``gemma3_text`` model and tokenizer.

Gemma 3 files come in llama.cpp's K-quants (Q4_K_M mixes Q4_K, Q6_K, Q5_0 and
Q8_0), which ``mx.load`` does not read. The ``gguf`` package (llama.cpp's own
reader) reads every GGML type and dequantizes it with numpy; the weights are
dequantized once, at load, into dense arrays of the model's dtype. They are
not requantized to mlx's affine layout: Q4_K and Q6_K scale 16- and 32-value
sub-blocks by 6- and 8-bit sub-scales of a super-block scale, which mlx's
groups (32 values or more, one fp16 scale and bias each) cannot hold exactly,
so requantizing would round a second time and the model would no longer be
the file's. Dense costs memory (fp32: ~1.1 GB, fp16: ~0.54 GB, most of it the
262,144-row embedding), not accuracy.

llama.cpp's conventions undone here:

- norms: Gemma's RMSNorm scales by ``1 + weight``; the converter stored
  ``weight + 1``, so 1 is taken back off (mlx-lm adds it again).
- the embedding is stored unscaled (the model multiplies by sqrt(hidden)),
  and tied to the output (no ``output.weight``).
- Q and K rows are not permuted (Gemma's RoPE is not interleaved).
- sliding windows: ``gemma3.attention.sliding_window`` (512) on every layer
  but each ``sliding_window_pattern``-th (6, llama.cpp's default for Gemma 3
  when the file does not say), local RoPE base 10,000 (fixed in llama.cpp).

The vocabulary is SentencePiece-style BPE with byte fallback; the file lists
no merges, so they are derived from the vocabulary, ranked by each token's
place in it (transformers' GGUF reader does the same: Gemma's scores do not
follow its merge order). The file carries no chat template (the base model's);
Gemma's turn format is supplied.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import mlx.core as mx
import numpy as np

from .gguf_names import GEMMA3_LAYER_NAMES, rename_tensor

__all__ = ["load_gemma3", "GEMMA_CHAT_TEMPLATE"]

# Gemma's turn format (a system message opens the first user turn, as Gemma 3's own template does)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _strings(reader, key: str) -> list[str]:
    """A string array, read off the field's parts (``contents()`` is ~100x slower on 262,144 tokens)."""
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]


def _numbers(reader, key: str) -> np.ndarray:
    f = reader.fields[key]
    return np.concatenate([f.parts[i] for i in f.data]) if len(f.data) else np.zeros(0)


def _config(reader) -> dict:
    a = lambda k, d=None: _field(reader, f"gemma3.{k}", d)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    scaling = None
    if a("rope.scaling.type") not in (None, "none"):
        if a("rope.scaling.type") != "linear":
            raise ValueError(f"RoPE scaling {a('rope.scaling.type')!r} is not supported by load_gguf")
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    return dict(
        model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=int(a("block_count")),
        intermediate_size=int(a("feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(a("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        rope_theta=float(a("rope.freq_base", 1_000_000.0)), rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=float(head_dim), sliding_window=int(a("attention.sliding_window", 512)),
        sliding_window_pattern=int(a("attention.sliding_window_pattern", 6)),
        max_position_embeddings=int(a("context_length", 32768)), rope_scaling=scaling,
    )


def _weights(reader, dtype: mx.Dtype) -> dict[str, mx.array]:
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])  # ggml lists dims inner-first
        name = rename_tensor(t.name, GEMMA3_LAYER_NAMES, "gemma3_text")
        if name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        out[name] = mx.array(w).astype(dtype)
    return out


def _merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by the vocabulary: every split of a token into two
    tokens, ranked by the merged token's place, then the longer left part first
    (the order transformers' GGUF reader gives)."""
    rank = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in rank and b in rank:
                merges.append((i, -len(a), a, b))
    merges.sort()
    return [(m[2], m[3]) for m in merges]


def _tokenizer(reader):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "llama":
        raise ValueError(f"load_gguf reads Gemma's SentencePiece ('llama') vocabulary, this one is {kind!r}")
    # a token of two or more spaces is stored with real spaces; the text it matches is normalized to '▁'
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in _strings(reader, "tokenizer.ggml.tokens")]
    types = _numbers(reader, "tokenizer.ggml.token_type").tolist()
    name = lambda key: tokens[int(_field(reader, f"tokenizer.ggml.{key}_token_id"))]  # noqa: E731
    unk = name("unknown")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, _merges(tokens), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # control tokens (3) stay whole and are special; user-defined ones (4: runs of newlines, tabs, ...) stay whole
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])
    bos = name("bos")
    if _field(reader, "tokenizer.ggml.add_bos_token", True):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=name("eos"), unk_token=unk,
                                 pad_token=name("padding"),
                                 chat_template=_field(reader, "tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE)
    # a model turn ends with <end_of_turn>: a stop token beside <eos>
    stops = [tokens.index("<end_of_turn>")] if "<end_of_turn>" in tokens else []
    return TokenizerWrapper(hf, eos_token_ids=stops)


def load_gemma3(path: Union[str, os.PathLike], dtype: mx.Dtype, reader=None):
    """``(model, tokenizer)`` from a Gemma 3 GGUF file (see the module docstring).
    ``reader``: the file's ``gguf.GGUFReader`` when the caller has one (making
    one parses 262,144 tokens' metadata: ~15 s on a slow CPU)."""
    from gguf import GGUFReader
    from mlx_lm.models import gemma3_text

    reader = reader or GGUFReader(Path(path))
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"load_gemma3 reads gemma3 GGUF files, this one is {arch!r}")
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(_config(reader)))
    weights = _weights(reader, dtype)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, _tokenizer(reader)
