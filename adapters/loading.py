"""A model that cannot be loaded, said in one line (``kvstore serve``,
``kvstore generate``): mlx-lm takes a path that does not exist for a Hugging
Face repo id and says the id is malformed."""

from __future__ import annotations

from pathlib import Path

from kvstore.errors import KVStoreError

from .gguf import TRAINED


class ModelLoadError(KVStoreError):
    """A model that cannot be loaded: the message names it and says why."""

    @classmethod
    def of(cls, spec, e: BaseException) -> "ModelLoadError":
        text = str(spec)
        if text not in TRAINED and text.startswith(("/", ".", "~")) and not Path(text).expanduser().exists():
            why = "no such file or folder"
        else:
            why = " ".join(str(e).split()) or type(e).__name__
        return cls(f"cannot load the model {text!r}: {why} (give an mlx-lm model folder, a GGUF file, "
                   f"'smollm2', 'gemma3' or a Hugging Face repo id in the local cache)")


def gguf_tokenizer(path: Path):
    """The tokenizer of a GGUF file, for ``kvstore inspect`` to show stored
    prompts as text; ``None`` for anything else."""
    from .gguf import _tokenizer, gguf_architecture, is_gguf

    if not is_gguf(path):
        return None
    if gguf_architecture(path) == "gemma3":
        from gguf import GGUFReader

        from .gguf_gemma3 import _tokenizer as gemma3_tokenizer

        return gemma3_tokenizer(GGUFReader(path))
    import mlx.core as mx

    _, meta = mx.load(str(path), return_metadata=True)
    return _tokenizer(meta)
