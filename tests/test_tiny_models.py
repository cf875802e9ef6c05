"""Tests for kvstore.adapters.tiny_models: tiny fixed-seed mlx-lm model folders."""

import hashlib
import json

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvstore.adapters.tiny_models import (  # noqa: E402
    EXPECTED_CACHES,
    KINDS,
    default_model_dir,
    ensure_tiny_model,
    main,
    make_tiny_model,
)

REQUIRED = ("llama", "gemma3_text", "qwen3_next")
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a short story about a baker."},
]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _greedy(model, tokenizer, prompt, n=32):
    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n)
    ]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One folder per kind, shared by the tests of this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in KINDS}


def test_required_kinds_cover_every_cache_family(built):
    """The three kinds the adapter and bench rely on give, between them, full
    attention, a sliding window and recurrent state."""
    classes = {}
    for kind in REQUIRED:
        model, _ = mlx_lm.load(str(built[kind]))
        classes[kind] = {type(c).__name__ for c in make_prompt_cache(model)}
    assert classes == {
        "llama": {"KVCache"},
        "gemma3_text": {"KVCache", "RotatingKVCache"},
        "qwen3_next": {"KVCache", "ArraysCache"},
    }


@pytest.mark.parametrize("kind", KINDS)
def test_load_and_cache_classes(built, kind):
    path = built[kind]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file()
    model, tokenizer = mlx_lm.load(str(path))
    caches = make_prompt_cache(model)
    assert [type(c).__name__ for c in caches] == EXPECTED_CACHES[kind]
    config = json.loads((path / "config.json").read_text())
    for c in caches:
        if type(c).__name__ == "RotatingKVCache":
            assert c.max_size == config["sliding_window"]
    assert model.model.embed_tokens.weight.dtype == mx.float16

    # Prefill fills every cache; attention caches hold float16 K/V.
    ids = tokenizer.encode("The baker lit her oven before the sun rose. " * 12)
    assert len(ids) > config.get("sliding_window", 0)  # wraps gemma's window
    logits = model(mx.array(ids)[None], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert not mx.isnan(logits).any().item()
    for c in caches:
        if type(c).__name__ == "ArraysCache":
            assert all(a is not None for a in c.cache)
        else:
            assert c.offset == len(ids)
            assert c.keys.dtype == mx.float16
            assert c.keys.shape[-1] == config["head_dim"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_is_deterministic_and_varied(built, kind):
    model, tokenizer = mlx_lm.load(str(built[kind]))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert isinstance(prompt, list) and prompt[0] == tokenizer.bos_token_id
    first = _greedy(model, tokenizer, prompt)
    assert len(first) == 32  # no EOS: generation is never cut short
    assert not set(first) & tokenizer.eos_token_ids
    assert len(set(first)) >= 8  # not one token repeated forever
    assert _greedy(model, tokenizer, prompt) == first
    model2, tokenizer2 = mlx_lm.load(str(built[kind]))
    assert _greedy(model2, tokenizer2, prompt) == first
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=32)
    full = tokenizer.decode(first)
    # mlx-lm's BPEStreamingDetokenizer drops a leading space of the output.
    assert text == (full[1:] if full.startswith(" ") else full)


@pytest.mark.parametrize("kind", REQUIRED)
def test_same_seed_same_bytes(tmp_path, built, kind):
    again = make_tiny_model(kind, tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha(again / name) == _sha(built[kind] / name), name
    other = make_tiny_model(kind, tmp_path / "other", seed=1)
    assert _sha(other / "model.safetensors") != _sha(built[kind] / "model.safetensors")
    assert _sha(other / "tokenizer.json") == _sha(built[kind] / "tokenizer.json")


def test_idempotent_and_rebuilds_on_change(tmp_path):
    path = tmp_path / "m"
    make_tiny_model("llama", path)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert make_tiny_model("llama", path) == path
    assert weights.stat().st_mtime_ns == stamp  # not rewritten

    make_tiny_model("llama", path, num_hidden_layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    model, _ = mlx_lm.load(str(path))
    assert len(make_prompt_cache(model)) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left

    # An empty existing folder (like pytest's tmp_path) is fine...
    empty = tmp_path / "empty"
    empty.mkdir()
    make_tiny_model("llama", empty)
    # ...but a folder with someone else's files is never clobbered.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_tiny_model("llama", foreign)


def test_bfloat16_override(tmp_path):
    path = make_tiny_model("qwen3_next", tmp_path / "bf16", dtype="bfloat16")
    model, tokenizer = mlx_lm.load(str(path))
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array(tokenizer.encode("hello there"))[None], cache=caches))
    kv = [c for c in caches if type(c).__name__ == "KVCache"]
    assert kv and all(c.keys.dtype == mx.bfloat16 for c in kv)
    with pytest.raises(ValueError):
        make_tiny_model("llama", tmp_path / "bad", dtype="int8")
    with pytest.raises(ValueError):
        make_tiny_model("nope", tmp_path / "bad")


def test_tokenizer_round_trip_and_chat_template(built):
    _, tokenizer = mlx_lm.load(str(built["llama"]))
    assert len(tokenizer._tokenizer) == 1024  # the wrapper has len() only from mlx-lm 0.32
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return x * 2\n",
        "Unicode too: café, 日本語, ☕.",
    ]:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<s><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nTell me a short story about a baker.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_vocabulary_under_the_byte_level_floor_is_character_level(tmp_path):
    """vocab_size=105 (issue 43: a model any made-up id past 104 crashes): a
    character-level tokenizer whose every id fits the vocabulary, which
    writes English text and generates within it."""
    model, tokenizer = mlx_lm.load(str(make_tiny_model("llama", tmp_path / "m", vocab_size=105)))
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert max(ids) < 105 and model.args.vocab_size == 105
    assert tokenizer.decode(tokenizer.encode("A baker, 2 loaves!\n", add_special_tokens=False)) == "A baker, 2 loaves!\n"
    assert max(_greedy(model, tokenizer, ids, n=8)) < 105
    with pytest.raises(ValueError, match="vocab_size must be >= 102"):
        make_tiny_model("llama", tmp_path / "tiny", vocab_size=50)


def test_ensure_and_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSTORE_MODEL_DIR", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache"
    p1 = ensure_tiny_model("llama", seed=3)
    assert p1.parent == tmp_path / "cache"
    assert ensure_tiny_model("llama", seed=3) == p1
    assert ensure_tiny_model("llama", seed=4) != p1

    assert main(["gemma3_text", str(tmp_path / "cli"), "--set", "sliding_window=128"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["sliding_window"] == 128
