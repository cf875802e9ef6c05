"""llama.cpp's tensor names -> mlx-lm's, for the GGUF readers (``gguf`` for
llama, ``gguf_gemma3`` for Gemma 3)."""

from __future__ import annotations

__all__ = ["rename_tensor", "LLAMA_LAYER_NAMES", "GEMMA3_LAYER_NAMES"]

LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GEMMA3_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def rename_tensor(name: str, layer_names: dict, model: str) -> str:
    """llama.cpp's tensor name (``blk.3.attn_q.weight``) -> mlx-lm's (``model.layers.3.self_attn.q_proj.weight``)."""
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in layer_names:
        return ".".join(["model.layers", parts[1], layer_names[parts[2]], *parts[3:]])
    if parts[0] in _TOP_NAMES:
        return ".".join([_TOP_NAMES[parts[0]], *parts[1:]])
    raise ValueError(f"GGUF tensor {name!r} has no place in mlx-lm's {model} model")
