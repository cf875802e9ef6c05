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
