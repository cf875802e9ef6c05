"""The 8B-shaped llama of the GPU figures (``gpu_bench.sh model``): the shape is what a replay or a cost
table times (prefills and caches), not what the model says, so its weights are mlx-lm's own random
initialization, drawn on the device in a minute where the tiny models' fixed-seed host weights take several."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

SHAPE_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, head_dim=128, max_position_embeddings=65536)


def make_model(path: Path) -> Path:
    """The 8B-shaped llama at ``path`` (bf16, the tiny llama's tokenizer), unless one is there already."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from kvstore.adapters.tiny_models import make_tiny_model, model_config

    if (path / "model.safetensors").exists() and json.loads((path / "config.json").read_text()).get("shape") == "8B":
        return path
    config = dict(model_config("llama", **SHAPE_8B), dtype="bfloat16", torch_dtype="bfloat16", shape="8B")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".8b-", dir=path.parent))
    small = make_tiny_model("llama", tmp / "small", max_position_embeddings=SHAPE_8B["max_position_embeddings"])
    for f in small.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(small)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path
