"""oMLX's engine on the store (kvstore.adapters.omlx): the same temperature-0
answers as with oMLX's own paged SSD cache and with none, repeats computing one
token, and a store written by a process killed with SIGKILL serving the next
one, with first-token times a fraction of a cold prefill's.

oMLX (flyto-mlx 0.7.0) pins mlx-lm 0.31.3, so these run in a CI lane of their
own (.ci/run); without omlx they skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("omlx.scheduler", reason="oMLX is not installed here: .ci/run's oMLX lane installs it "
                                             "(flyto-mlx 0.7.0 with mlx-lm 0.31.3)")

from mlx_lm import load  # noqa: E402
from omlx.engine_core import EngineConfig, EngineCore  # noqa: E402
from omlx.request import SamplingParams  # noqa: E402
from omlx.scheduler import SchedulerConfig  # noqa: E402
import omlx.scheduler as omlx_scheduler  # noqa: E402

from kvstore import PrefixStore  # noqa: E402
from kvstore.adapters import omlx as A  # noqa: E402
from kvstore.adapters.tiny_models import make_tiny_model  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402

BLOCK = 64
SYSTEM = "You are a helpful assistant who answers briefly and exactly. " * 12
QUESTIONS = ["What is two plus two?", "Name a color.", "What is two plus two?", "Say hello in French."]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # wide enough that a 2,000-token prefill outweighs the engine's per-request overhead on a CPU
    path = make_tiny_model("llama", tmp_path_factory.mktemp("models") / "llama", hidden_size=256,
                           intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=8192)
    model, tokenizer = load(str(path))
    return path, model, tokenizer


def chat(tokenizer, question: str, system: str = SYSTEM) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def engine(model, tokenizer, ssd_dir=None) -> EngineCore:
    config = SchedulerConfig(paged_ssd_cache_dir=str(ssd_dir) if ssd_dir else None, paged_cache_block_size=BLOCK)
    return EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))


def answer(eng: EngineCore, prompt: list[int], max_tokens: int = 10) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return eng.generate_batch_sync([prompt], params)[0].output_token_ids


def first_token_s(eng: EngineCore, prompt: list[int]) -> float:
    t = time.perf_counter()
    answer(eng, prompt, max_tokens=1)
    return time.perf_counter() - t


def open_store(path) -> PrefixStore:
    return PrefixStore(budget_gb=1, ssd_path=str(path), block_size=BLOCK)


def test_answers_at_temperature_0_equal_omlx_own_cache_and_none(llama, tmp_path):
    path, model, tokenizer = llama
    prompts = [chat(tokenizer, q) for q in QUESTIONS]

    def run(eng):
        try:
            return [answer(eng, p) for p in prompts]
        finally:
            eng.close()

    none = run(engine(model, tokenizer))
    own = run(engine(model, tokenizer, tmp_path / "omlx-own"))
    store = open_store(tmp_path / "store")
    with A.install(store, model_path=path) as installed:
        eng = engine(model, tokenizer, tmp_path / "omlx-scratch")
    assert isinstance(eng.scheduler.block_aware_cache, A.StoreBlockCache)
    assert omlx_scheduler.BlockAwarePrefixCache is installed._original  # uninstalled on leaving the with
    on_store = []
    try:
        for p in prompts:
            on_store.append(answer(eng, p))
            installed.flush()
        stats = eng.scheduler.block_aware_cache.get_stats()  # read before close() resets them
    finally:
        eng.close()
        store.close()
    assert on_store == own == none
    assert stats.misses == 1 and stats.hits == 3  # the shared system prompt, then the repeated question
    assert stats.tokens_saved >= len(prompts[2]) - 1


@pytest.mark.parametrize("kind", ["qwen3_next", "gemma3_text"])
def test_hybrid_models_share_a_system_prompt_through_block_snapshots(kind, tmp_path):
    """A model whose cache cannot be cut back (recurrent layers; sliding windows) has its prompt's whole
    blocks computed at the fetch, a snapshot offered at each boundary: a second question on the same
    system prompt starts at least from the shared prefix's last whole block, with oMLX's own answers."""
    path = make_tiny_model(kind, tmp_path / kind)
    model, tokenizer = load(str(path))
    prompts = [chat(tokenizer, q) for q in QUESTIONS[:2]]
    none = engine(model, tokenizer)
    try:
        alone = [answer(none, p) for p in prompts]
    finally:
        none.close()
    store = open_store(tmp_path / "store")
    with A.install(store, model_path=path, calibrate_prefill=False) as installed:
        eng = engine(model, tokenizer, tmp_path / "omlx-scratch")
    try:
        first = answer(eng, prompts[0])
        installed.flush()
        before = store.stats()["tokens_ram"]
        second = answer(eng, prompts[1])
        served = store.stats()["tokens_ram"] - before
    finally:
        eng.close()
        store.close()
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert [first, second] == alone
    assert 0 < shared // BLOCK * BLOCK <= served <= shared  # (a window not yet wrapped is cut back mid-block)


def test_repeat_and_restart_after_sigkill_are_served_from_the_store(llama, tmp_path):
    """A repeat computes one token; a process killed with SIGKILL after
    answering leaves its KV on disk for the next; both first tokens take a
    fraction of a cold prefill's time."""
    path, model, tokenizer = llama
    long_system = "Answer from the following notes only. " + " ".join(f"Note {i}: item {i * 7} is blue." for i in range(80))
    prompt = chat(tokenizer, "What colour is item 14?", long_system)
    assert len(prompt) > 1000
    store_path = tmp_path / "store"
    err = tmp_path / "child.err"
    with open(err, "w") as errors:
        child = subprocess.Popen([sys.executable, "-m", "tests._omlx_child", str(path), str(store_path),
                                  json.dumps(prompt)], stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        line = child.stdout.readline()
        assert line, f"the child answered nothing: {err.read_text()[-2000:]}"
        written = json.loads(line)
    finally:
        child.kill()  # SIGKILL: no shutdown hook runs
        child.wait()

    store = open_store(store_path)
    installed = A.install(store, model_path=path, calibrate_prefill=False)
    eng = engine(model, tokenizer, tmp_path / "omlx-scratch")
    installed.uninstall()
    cache = eng.scheduler.block_aware_cache
    try:
        answer(eng, chat(tokenizer, "warm up"), max_tokens=2)
        saved = cache.get_stats().tokens_saved
        restarted = first_token_s(eng, prompt)  # from the killed process's blocks on disk
        assert cache.get_stats().tokens_saved - saved == len(prompt) - 1
        assert store.stats()["tokens_ssd"] >= len(prompt) - 1 - BLOCK
        assert answer(eng, prompt, max_tokens=8) == written
        colds = []
        for i in range(2):  # same length, nothing in common with what is stored
            other = chat(tokenizer, "What colour is item 14?", f"{i}{i} " + long_system)
            colds.append(first_token_s(eng, other))
            installed.flush()
        repeat = min(first_token_s(eng, prompt) for _ in range(2))
        cold = min(colds)
        print(f"first token: cold {cold * 1000:.0f} ms, after restart {restarted * 1000:.0f} ms "
              f"({restarted / cold:.2f}x), repeat {repeat * 1000:.0f} ms ({repeat / cold:.2f}x); {len(prompt)} tokens")
        assert restarted <= 0.3 * cold and repeat <= 0.3 * cold
    finally:
        eng.close()
        store.close()


def test_image_keyed_prompts_are_neither_served_nor_stored(llama, tmp_path):
    path, model, tokenizer = llama
    store = open_store(tmp_path / "store")
    cache = A.StoreBlockCache(store, model, model_path=path, calibrate_prefill=False)
    prompt = chat(tokenizer, QUESTIONS[0])
    eng = engine(model, tokenizer)
    try:
        answer(eng, prompt)
    finally:
        eng.close()
    from mlx_lm.models.cache import make_prompt_cache
    import mlx.core as mx

    kv = make_prompt_cache(model)
    model(mx.array([prompt]), cache=kv)
    cache.store_cache("a", prompt, kv, extra_keys=("image-1",))
    cache.flush()
    assert store.sequences == 0
    cache.store_cache("a", prompt, kv)
    cache.flush()
    table, rest = cache.fetch_cache("b", prompt, extra_keys=("image-2",))
    assert table is None and rest == prompt
    table, rest = cache.fetch_cache("c", prompt)
    assert table and table.num_tokens == len(prompt) - 1 and rest == prompt[-1:]
    assert len(cache.reconstruct_cache(table)) == len(kv)
    assert cache.reconstruct_cache(table) is None  # handed over once
    cache.close()
    store.close()


def test_a_changed_omlx_is_refused_by_name(llama, tmp_path, monkeypatch):
    path, model, tokenizer = llama
    store = open_store(tmp_path / "store")
    try:
        eng = engine(model, tokenizer)  # no paged_ssd_cache_dir: oMLX builds no prefix cache to replace
        try:
            with pytest.raises(ConfigError, match="paged_ssd_cache_dir"):
                A.attach(eng, store)
        finally:
            eng.close()
        monkeypatch.setattr(omlx_scheduler.BlockAwarePrefixCache, "fetch_cache", lambda self, tokens: None)
        with pytest.raises(A.OmlxUnsupported, match=r"\(flyto-mlx\) 0\.7\.0 .*fetch_cache"):
            A.install(store)
        assert omlx_scheduler.BlockAwarePrefixCache.__name__ == "BlockAwarePrefixCache"  # nothing replaced
    finally:
        store.close()


# ------------------------------------------------------------ kvstore omlx serve


def serve_omlx(models, store, port, log, home):
    from .test_server import launch

    cmd = [sys.executable, "-m", "kvstore.adapters.cli", "omlx", "serve", "--ssd-path", str(store), "--budget-gb", "1",
           "--block-size", str(BLOCK), "--calibrate-budget-s", "0", "--model-dir", str(models), "--host", "127.0.0.1",
           "--port", str(port)]
    return launch(cmd, port, log, env=dict(os.environ, HOME=str(home)))  # (oMLX keeps its settings under ~)


def test_kvstore_omlx_serve_reports_cached_tokens_and_keeps_them_across_restart(tmp_path):
    """oMLX's own server, every model it discovers on the store: a second conversation sharing the system
    prompt reports it cached (oMLX's own usage field), SIGTERM writes the store out, and the server started
    again answers the first conversation the same from the store."""
    from .test_server import chat, free_port, stop

    make_tiny_model("llama", tmp_path / "models" / "tiny")
    store, home = tmp_path / "store", tmp_path / "home"
    with open(tmp_path / "serve.log", "wb") as log:
        proc = serve_omlx(tmp_path / "models", store, port := free_port(), log, home)
        try:
            first = chat(port, "hello there", full=True, model="tiny")
            other = chat(port, "how are you today", model="tiny")
        finally:
            stop(proc)
        proc = serve_omlx(tmp_path / "models", store, port := free_port(), log, home)
        try:
            again = chat(port, "hello there", full=True, model="tiny")
        finally:
            stop(proc)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["prompt_tokens_details"]["cached_tokens"] >= 640  # the system prompt's whole blocks
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - BLOCK
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert not list((home / ".fmlx" / "cache").rglob("*.safetensors"))  # oMLX's own SSD cache got no block


QUESTION = "What is the weather like today?"


def _omlx_serve_once(models, store, tmp_path) -> dict:
    """One chat request (test_server's system prompt, then ``QUESTION``) to a fresh ``kvstore omlx serve`` on
    the store, stopped with SIGTERM (the store written out): the whole response."""
    from .test_server import chat, free_port, stop

    with open(tmp_path / "serve.log", "ab") as log:
        proc = serve_omlx(models, store, port := free_port(), log, tmp_path / "home")
        try:
            return chat(port, QUESTION, full=True, model="tiny")
        finally:
            stop(proc)


@pytest.mark.parametrize("server_first", [True, False], ids=["server-then-generate", "generate-then-server"])
def test_a_prompt_stored_by_kvstore_omlx_serve_or_kvstore_generate_is_served_by_the_other(server_first, tmp_path):
    """Issue 51: one model folder, one key in oMLX's engine pool and in ``kvstore generate``. oMLX's chat
    endpoint renders the template to text and tokenizes that with the special tokens (``Scheduler.add_request``:
    ``tokenizer.encode(prompt)``), so the tiny model's template, which writes BOS itself, gets it twice;
    ``kvstore generate`` is given that text with ``--ignore-chat-template`` (``test_one_key.rendered_chat``)."""
    from .test_one_key import across_a_server
    from .test_server import SYSTEM

    model = make_tiny_model("llama", tmp_path / "models" / "tiny")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    across_a_server(lambda store: _omlx_serve_once(model.parent, store, tmp_path), model, messages, tmp_path,
                    BLOCK, server_first)


@pytest.mark.parametrize("option, says", [("--no-cache", "run omlx serve itself"),
                                          ("--hot-cache-max-size=4GB", "--budget-gb"),
                                          ("--paged-ssd-cache-max-size", "--disk-budget-gb")])
def test_kvstore_omlx_serve_refuses_omlx_own_cache_options_naming_the_stores(option, says):
    done = subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", "omlx", "serve", option, "10GB"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr and option.split("=")[0] in done.stderr
