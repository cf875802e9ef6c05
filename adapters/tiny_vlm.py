"""A tiny, fixed-seed vision-language model that mlx-lm's server runs.

mlx-lm 0.32's server takes images for any model whose config has a
``vision_config`` and a processor it knows (``processor_type``): it expands
each image part of the chat to ``<|image_start|>`` + one ``<|patch|>`` per
image token + ``<|image_end|>`` (the Muse Spark processor, which only resizes
and normalizes), computes the prompt's embeddings with the model's
``embed_inputs(tokens, pixel_values=...)``, and keys its prompt cache by
``Vision.cache_key``: the prompt with every patch token of an image replaced
by one negative ~60-bit id derived from the image's URL.

The only VLM mlx-lm ships (Muse Spark) runs Metal kernels, so this one is the
tiny llama of :mod:`kvstore.adapters.tiny_models` plus a vision tower of one
linear layer over 28x28-pixel patches, loaded through mlx-lm's ``model_file``
mechanism (the server needs ``--trust-remote-code``). Everything the server
does with images is then real: processor, pixel embedding, cache key.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any

import numpy as np

from .tiny_models import make_tiny_model
from .tiny_tokenizer import CHAT_TEMPLATE

__all__ = ["make_tiny_vlm", "IMAGE_TOKENS", "PATCH_PIXELS"]

IMAGE_TOKENS = ("<|image_start|>", "<|patch|>", "<|image_end|>")  # the Muse Spark processor's
PATCH_PIXELS = 28  # side of one image token: patch_size 14, merge_size 2

MODEL_FILE = "tiny_vlm_model.py"
_MODEL_SOURCE = '''\
"""mlx-lm's llama plus a one-layer vision tower (kvstore.adapters.tiny_vlm)."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    vision_config: Optional[dict] = None
    image_token_id: int = 0


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.patch = args.vision_config["patch_size"] * args.vision_config["merge_size"]
        self.vision_proj = nn.Linear(3 * self.patch * self.patch, args.hidden_size)

    def encode_image(self, pixels: mx.array) -> mx.array:
        """(3, H, W) -> one row per patch, row-major."""
        c, h, w = pixels.shape
        p = self.patch
        x = pixels.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
        return self.vision_proj(x.reshape((h // p) * (w // p), c * p * p).astype(self.vision_proj.weight.dtype))

    def embed_inputs(self, inputs: mx.array, *, pixel_values=None) -> mx.array:
        """The input embeddings, with the image rows at the patch tokens, in order."""
        h = self.model.embed_tokens(inputs)
        if pixel_values:
            rows = mx.concatenate([self.encode_image(p) for p in pixel_values])
            mask = inputs == self.args.image_token_id
            idx = mx.clip(mx.cumsum(mask.astype(mx.int32)) - 1, 0, rows.shape[0] - 1)
            h = mx.where(mask[..., None], rows[idx].astype(h.dtype), h)
        return h
'''

# the chat template of the tiny models, with an image part as one <|patch|> (the processor expands it)
_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}",
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image_url', 'input_image', 'image'] %}<|patch|>{% endif %}",
)


def _json(path: pathlib.Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_vlm(path: "str | pathlib.Path", *, seed: int = 0) -> pathlib.Path:
    """Write the tiny VLM's folder at ``path`` (new or empty) and return it."""
    import mlx.core as mx

    dst = pathlib.Path(path)
    dst.mkdir(parents=True, exist_ok=True)
    if any(dst.iterdir()):
        raise FileExistsError(f"{dst} is not empty")
    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny_model("llama", pathlib.Path(tmp) / "base", seed=seed)
        config = _json(base / "config.json")
        n_text = config["vocab_size"]  # the text tokenizer fills the vocabulary: image tokens come after it
        ids = {t: n_text + i for i, t in enumerate(IMAGE_TOKENS)}
        config.update(vocab_size=n_text + len(IMAGE_TOKENS), model_file=MODEL_FILE, processor_type="muse_spark",
                      vision_config={"patch_size": PATCH_PIXELS // 2, "merge_size": 2},
                      image_token_id=ids[IMAGE_TOKENS[1]])
        _write_json(dst / "config.json", config)
        (dst / MODEL_FILE).write_text(_MODEL_SOURCE, encoding="utf-8")
        (dst / "generation_config.json").write_bytes((base / "generation_config.json").read_bytes())

        tok = _json(base / "tokenizer.json")
        for t, i in ids.items():
            tok["added_tokens"].append({"id": i, "content": t, "single_word": False, "lstrip": False,
                                        "rstrip": False, "normalized": False, "special": True})
        _write_json(dst / "tokenizer.json", tok)
        tok_config = _json(base / "tokenizer_config.json")
        for t, i in ids.items():
            tok_config["added_tokens_decoder"][str(i)] = {"content": t, "lstrip": False, "normalized": False,
                                                          "rstrip": False, "single_word": False, "special": True}
        tok_config["chat_template"] = _TEMPLATE
        _write_json(dst / "tokenizer_config.json", tok_config)
        special = _json(base / "special_tokens_map.json")
        special["additional_special_tokens"] += list(IMAGE_TOKENS)
        _write_json(dst / "special_tokens_map.json", special)

        weights = dict(mx.load(str(base / "model.safetensors")))
    rng = np.random.default_rng([seed, 2024])
    hidden = config["hidden_size"]
    emb = weights["model.embed_tokens.weight"]
    extra = rng.standard_normal((len(IMAGE_TOKENS), hidden)).astype(np.float32)
    weights["model.embed_tokens.weight"] = mx.concatenate([emb, mx.array(extra).astype(emb.dtype)])
    head = weights["lm_head.weight"]  # image tokens are never predicted: zero rows
    weights["lm_head.weight"] = mx.concatenate([head, mx.zeros((len(IMAGE_TOKENS), hidden), head.dtype)])
    n_in = 3 * PATCH_PIXELS * PATCH_PIXELS
    proj = rng.standard_normal((hidden, n_in)).astype(np.float32) * n_in**-0.5 * 4.0  # an image moves the answer
    weights["vision_proj.weight"] = mx.array(proj).astype(emb.dtype)
    weights["vision_proj.bias"] = mx.zeros((hidden,), emb.dtype)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst
