"""A registered model's tokenizer, for the commands that show stored prompts as text (``kvstore inspect``) or
turn a prompt's text into tokens (``kvstore explain --prompt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

# Where a model's tokenizer is not a tokenizer.json in its folder: functions of the registered path giving a
# tokenizer (``decode(ids, skip_special_tokens=False)``) or None. kvstore.adapters adds GGUF files'.
TOKENIZER_LOADERS: list[Callable[[Path], Any]] = []


def tokenizer(path: Path):
    if Path(path, "tokenizer.json").exists():
        # the tokenizers library alone: transformers would say on stderr that PyTorch is missing
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(Path(path, "tokenizer.json")))
    return next((t for load in TOKENIZER_LOADERS if (t := load(path)) is not None), None)


def encode(tok, text: str) -> list[int]:
    """The token ids of ``text`` (a ``tokenizers.Tokenizer``'s encoding, or a tokenizer's list of ids)."""
    got = tok.encode(text)
    return [int(t) for t in getattr(got, "ids", got)]
