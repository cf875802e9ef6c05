"""vllm-mlx's engine on the store (kvstore.adapters.vllm_mlx): the same
temperature-0 outputs as with vllm-mlx's own cache and with none, and what the
store adds — exact repeats computing one token, hits after a restart and from
another store through the remote tier, quantized entries.

vllm-mlx pins mlx-lm < 0.32, so these run in CI's second lane (.ci/run builds a
virtualenv with mlx-lm 0.31.3 and vllm-mlx 0.6.0); without vllm-mlx they skip.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
import re
import sys
import urllib.request

import pytest

pytest.importorskip("vllm_mlx", reason="vllm-mlx is not installed here: .ci/run's second lane installs it "
                                       "(vllm-mlx 0.6.0 with mlx-lm 0.31.3)")

from mlx_lm import load  # noqa: E402
from vllm_mlx.engine_core import EngineConfig, EngineCore  # noqa: E402
from vllm_mlx.request import SamplingParams  # noqa: E402
from vllm_mlx.scheduler import SchedulerConfig  # noqa: E402
import vllm_mlx.scheduler as vllm_scheduler  # noqa: E402

from kvstore import PrefixStore  # noqa: E402
from kvstore.adapters import vllm_mlx as V  # noqa: E402
from kvstore.adapters import vllm_mlx_serve  # noqa: E402
from kvstore.adapters.tiny_models import make_tiny_model  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.tools.bench.vllm_mlx_ttft import Server  # noqa: E402

BLOCK = 64
SYSTEM = "You are a helpful assistant who answers briefly and exactly. " * 12
QUESTIONS = ["What is two plus two?", "Name a color.", "What is two plus two?", "Say hello in French."]


class Prefills(logging.Handler):
    """The tokens vllm-mlx's scheduler prefills per request, read from its own log line."""

    PATTERN = re.compile(r"\[schedule\].* tokens_to_prefill=(\d+)")

    def __init__(self):
        super().__init__(logging.INFO)
        self.counts: list[int] = []

    def emit(self, record):
        m = self.PATTERN.search(record.getMessage())
        if m:
            self.counts.append(int(m.group(1)))


@pytest.fixture
def prefills():
    logger = logging.getLogger("vllm_mlx.scheduler")
    handler, level = Prefills(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module", autouse=True)
def mlx_lm_generation_stream():
    """vllm-mlx points mlx-lm's module-level generation stream at a stream of
    its calling thread (``bind_generation_streams``); put mlx-lm's back for the
    tests that run after these in this process (mlx-lm's server on its own
    generation thread)."""
    import importlib

    import mlx.core as mx

    G = importlib.import_module("mlx_lm.generate")  # the module (the package's attribute is the function)
    stream, default = G.generation_stream, mx.default_stream(mx.default_device())
    yield
    G.generation_stream = stream
    mx.set_default_stream(default)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for kind in ("llama", "gemma3_text", "qwen3_next"):
        path = make_tiny_model(kind, root / kind)
        model, tokenizer = load(str(path))
        out[kind] = (path, model, tokenizer)
    return out


def chat(tokenizer, question: str, history: tuple = ()) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def conversation(tokenizer, answer_of) -> list[list[int]]:
    """Four users on one system prompt (one repeats another's question exactly),
    then a second turn of the first user carrying its first answer."""
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    first = answer_of(prompts[0])
    history = ({"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first})
    return prompts + [chat(tokenizer, "And three plus three?", history)]


def engine(model, tokenizer, cache: str) -> EngineCore:
    config = SchedulerConfig(enable_prefix_cache=cache != "none")
    return EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))


def generate(eng: EngineCore, prompt: list[int], max_tokens: int = 10) -> list[int]:
    return eng.generate_batch_sync([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].output_token_ids


def run(model, tokenizer, cache, prompts_of, store=None, path=None):
    """Outputs of each prompt, in order, through one engine."""
    installed = V.install(store, model_path=path) if store is not None else None
    try:
        eng = engine(model, tokenizer, "store" if store is not None else cache)
        if store is not None:
            assert isinstance(eng.scheduler.memory_aware_cache, V.StorePrefixCache)
        outs: list[list[int]] = []

        def answer(prompt):
            toks = generate(eng, prompt)
            outs.append(toks)
            return tokenizer.decode(toks)

        prompts = prompts_of(answer)
        for p in prompts[1:]:
            answer(p)
            if installed is not None:
                installed.flush()
        eng.close()
        return outs
    finally:
        if installed is not None:
            installed.uninstall()
            installed.close()


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "qwen3_next"])
def test_outputs_equal_vllm_mlx_own_cache_and_no_cache(models, kind, tmp_path, prefills):
    """Every request after the first starts from the store, at least from the
    system prompt's whole blocks; full attention (llama): the exact repeat
    computes one token. Sliding windows that wrapped (gemma3) and recurrent
    state (qwen3_next) cannot be cut back: the store computes their prompts'
    whole blocks at fetch, a snapshot at each boundary, and the scheduler
    prefills the rest (under a block)."""
    path, model, tokenizer = models[kind]
    prompts_of = lambda answer: conversation(tokenizer, answer)  # noqa: E731
    none = run(model, tokenizer, "none", prompts_of)
    prefills.counts.clear()
    builtin = run(model, tokenizer, "builtin", prompts_of)
    builtin_prefills = list(prefills.counts)
    prefills.counts.clear()
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK) as store:
        ours = run(model, tokenizer, "store", prompts_of, store=store, path=path)
    assert ours == builtin == none
    n = [len(p) for p in conversation(tokenizer, lambda p: tokenizer.decode(ours[0]))]
    assert prefills.counts[0] == (n[0] if kind == "llama" else n[0] - (n[0] - 1) // BLOCK * BLOCK)  # cold
    assert all(c <= b for c, b in zip(prefills.counts, builtin_prefills))
    assert prefills.counts[-1] < n[-1] - n[0]  # the follow-up starts after its first turn
    prompts = conversation(tokenizer, lambda p: tokenizer.decode(ours[0]))
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)  # the system prompt
    for count, length in zip(prefills.counts[1:], n[1:]):
        assert count <= length - shared // BLOCK * BLOCK  # at least the system prompt's whole blocks hit
    if kind == "llama":
        assert prefills.counts[2] == 1  # the exact repeat computes its last token only


def test_a_repeated_1500_token_prompt_computes_at_most_one_block(models, tmp_path, prefills):
    path, model, tokenizer = models["llama"]
    prompt = (chat(tokenizer, "x") * 20)[:1500]
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=256) as store, \
            V.install(store, model_path=path) as installed:
        eng = engine(model, tokenizer, "store")
        cold = generate(eng, prompt)
        installed.flush()
        hot = generate(eng, prompt)
        eng.close()
        installed.close()
    assert hot == cold
    assert prefills.counts == [1500, 1]


def test_the_store_outlives_the_engine_and_the_process_memory(models, tmp_path, prefills):
    """A new engine on a reopened store (a restart) starts from the SSD tier."""
    path, model, tokenizer = models["llama"]
    prompt = chat(tokenizer, "What is a prefix cache?")
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK) as store, \
            V.install(store, model_path=path) as installed:
        eng = engine(model, tokenizer, "store")
        cold = generate(eng, prompt)
        eng.close()
        installed.close()
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK) as store, \
            V.install(store, model_path=path) as installed:
        eng = engine(model, tokenizer, "store")
        again = generate(eng, prompt)
        stats = installed.caches[0].get_stats()
        eng.close()
        installed.close()
    assert again == cold
    assert prefills.counts == [len(prompt), 1]
    assert stats["kvstore"]["tokens_ssd"] == len(prompt) - 1 and stats["tokens_saved"] == len(prompt) - 1


def test_quantized_entries_are_served(models, tmp_path, prefills):
    path, model, tokenizer = models["llama"]
    prompt = chat(tokenizer, "Quantize me.")
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK, kv_bits=8) as store, \
            V.install(store, model_path=path) as installed:
        eng = engine(model, tokenizer, "store")
        generate(eng, prompt)
        installed.flush()
        generate(eng, prompt)
        eng.close()
        installed.close()
        blocks = store.stats()["blocks_indexed"]
    assert prefills.counts == [len(prompt), 1]
    assert blocks >= len(prompt) // BLOCK


def test_a_second_host_hits_through_the_remote_tier(models, tmp_path, prefills):
    from tests._redis import RedisServer, need_redis

    need_redis()
    path, model, tokenizer = models["llama"]
    prompt = chat(tokenizer, "Share this prefix.")
    redis = RedisServer(tmp_path / "redis").start()
    try:
        outs = []
        for host in ("a", "b"):  # two stores that share no file, only the Redis server
            with PrefixStore(budget_gb=1, ssd_path=tmp_path / host, block_size=BLOCK, remote=redis.url) as store, \
                    V.install(store, model_path=path) as installed:
                eng = engine(model, tokenizer, "store")
                outs.append(generate(eng, prompt))
                stats = installed.caches[0].get_stats()["kvstore"]
                eng.close()
                installed.close()
    finally:
        redis.kill()
    assert outs[0] == outs[1]
    assert prefills.counts == [len(prompt), 1]
    assert stats["tokens_remote"] == len(prompt) - 1


def test_an_engine_clearing_or_closing_leaves_the_shared_store_alone(models, tmp_path):
    """vllm-mlx clears its cache on an engine reset, on close and after an
    engine error: none of that says anything about stored KV, which other
    engines may be using."""
    path, model, tokenizer = models["llama"]
    prompt = chat(tokenizer, "Keep me.")
    with PrefixStore(budget_gb=1, block_size=BLOCK) as store, V.install(store, model_path=path) as installed:
        one, two = engine(model, tokenizer, "store"), engine(model, tokenizer, "store")
        generate(one, prompt)
        installed.flush()
        held = store.nbytes
        one.scheduler.clear_runtime_caches()  # what vllm-mlx's DELETE /v1/cache and its error recovery call
        one.close()  # resets its scheduler
        assert store.nbytes == held > 0
        cache, rest = two.scheduler.memory_aware_cache.fetch(prompt)
        assert one.scheduler.memory_aware_cache.get_stats()["hits"] == 0  # its counters were reset
        two.close()
        installed.close()
    assert cache is not None and len(rest) == 1


def test_an_unsupported_vllm_mlx_is_refused_by_name_and_nothing_is_replaced(monkeypatch, tmp_path):
    builtin = vllm_scheduler.MemoryAwarePrefixCache
    monkeypatch.delattr(vllm_scheduler.Scheduler, "SNAPSHOT_REFRESH_TOKENS")
    with PrefixStore(budget_gb=1) as store:
        with pytest.raises(V.VllmMlxUnsupported, match=r"vllm-mlx 0\.6\.0 .*SNAPSHOT_REFRESH_TOKENS"):
            V.install(store)
    assert vllm_scheduler.MemoryAwarePrefixCache is builtin


def test_a_method_the_scheduler_calls_that_the_adapter_lacks_is_refused(monkeypatch):
    source = "def f(self):\n    self.memory_aware_cache.brand_new_method()\n"
    assert V._called_on_cache(source) == {"brand_new_method"}
    real = V.inspect.getsource
    monkeypatch.setattr(V.inspect, "getsource",
                        lambda obj: real(obj) + source if obj is vllm_scheduler.Scheduler else real(obj))
    with pytest.raises(V.VllmMlxUnsupported, match="brand_new_method"):
        V.check_vllm_mlx()


def test_a_vllm_mlx_without_what_usage_reporting_relies_on_is_refused_at_start(monkeypatch, tmp_path):
    """Cached tokens in usage rely on EngineCore.add_request (a coroutine that
    hands the request to its scheduler): without it, no install, not a silent gap."""
    builtin = vllm_scheduler.MemoryAwarePrefixCache
    monkeypatch.setattr(EngineCore, "add_request", lambda self, prompt: "id")
    with PrefixStore(budget_gb=1) as store:
        with pytest.raises(V.VllmMlxUnsupported, match=r"vllm-mlx 0\.6\.0 .*EngineCore\.add_request.*usage"):
            V.install(store)
    assert vllm_scheduler.MemoryAwarePrefixCache is builtin


def test_attach_refuses_an_engine_without_the_memory_aware_cache(models):
    path, model, tokenizer = models["llama"]
    eng = engine(model, tokenizer, "none")
    with PrefixStore(budget_gb=1) as store, pytest.raises(ConfigError, match="memory-aware"):
        V.attach(eng, store)
    eng.close()


@pytest.mark.parametrize("option", ["--ssd-cache-dir=/tmp/x", "--use-paged-cache", "--kv-cache-quantization",
                                    "--cache-memory-mb", "--disable-prefix-cache"])
def test_serve_refuses_vllm_mlx_own_cache_options(option, capsys):
    with pytest.raises(SystemExit) as exit_:
        vllm_mlx_serve.parse_serve_args(["model", option])
    assert exit_.value.code == 2
    assert option.split("=")[0] in capsys.readouterr().err


def test_serve_maps_the_store_options_and_adds_continuous_batching():
    store_args, rest = vllm_mlx_serve.parse_serve_args(["./m", "--ssd-path", "/s", "--kv-bits", "8,4", "--budget-gb", "2",
                                           "--port", "8001"])
    assert store_args["ssd_path"] == "/s" and store_args["kv_bits"] == (8, 4) and store_args["budget_gb"] == 2
    assert rest == ["./m", "--port", "8001", "--continuous-batching"]


# ---------------------------------------------------------------------------
# kvstore vllm-mlx serve: real server processes on loopback
# ---------------------------------------------------------------------------


class Served(Server):
    """One ``kvstore vllm-mlx serve`` process on the tiny model."""

    def __init__(self, model, store, log_path, *extra: str):
        super().__init__([sys.executable, "-m", "kvstore.adapters.cli", "vllm-mlx", "serve", str(model),
                          "--ssd-path", str(store), "--block-size", str(BLOCK), *extra], log_path)

    def chat(self, question: str) -> str:
        body = {"model": self.model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM * 4}, {"role": "user", "content": question}]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)["choices"][0]["message"]["content"]

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/cache/stats", timeout=30) as r:
            return json.load(r)["engine_cache"]


def test_serve_repeats_from_the_store_shares_it_between_servers_and_survives_sigkill(models, tmp_path):
    path = models["llama"][0]
    store, log = tmp_path / "store", tmp_path / "serve.log"
    a = Served(path, store, log)
    b = None
    try:
        cold = a.chat("What is two plus two?")
        n = a.stats()["kvstore"]["tokens_requested"]
        assert a.chat("What is two plus two?") == cold
        stats = a.stats()
        assert stats["tokens_saved"] == n - 1 and stats["kvstore"]["tokens_ram"] == n - 1  # one token computed
        b = Served(path, store, log)  # a second server on the same ssd_path finds a's blocks on disk
        assert b.chat("What is two plus two?") == cold
        assert b.stats()["kvstore"]["tokens_ssd"] == n - 1
    finally:
        a.kill()  # SIGKILL: no shutdown hook runs
        if b is not None:
            b.kill()
    c = Served(path, store, log)
    try:
        assert c.chat("What is two plus two?") == cold
        stats = c.stats()
        assert stats["tokens_saved"] == n - 1 and stats["kvstore"]["tokens_ssd"] == n - 1
    finally:
        assert c.stop() == 0  # SIGTERM: a clean shutdown, store flushed and closed
    assert "store closed" in log.read_text()


def _kvstore_samples(port: int) -> dict[tuple, float]:
    """vllm-mlx's ``/metrics``, parsed by prometheus-client: every ``kvstore_`` sample (name and labels) and
    whether vllm-mlx's own series are there too (this is its registry, not a second endpoint)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert "vllm_mlx_http_requests_total" in text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("kvstore_")}


def test_serve_with_enable_metrics_adds_the_store_series_to_vllm_mlx_metrics(models, tmp_path):
    a = Served(models["llama"][0], tmp_path / "store", tmp_path / "serve.log", "--enable-metrics",
               "--ssd-admit", "reuse")
    try:
        before = _kvstore_samples(a.port)
        assert ("kvstore_requests_total", ()) in before and ("kvstore_bytes", (("tier", "ram"),)) in before
        a.chat("What is two plus two?")
        a.chat("What is two plus two?")  # a repeat: a hit from RAM, so (reuse) its blocks go to SSD
        after = _kvstore_samples(a.port)
    finally:
        assert a.stop() == 0
    changed = sorted(k[0] for k in after if after[k] != before.get(k))
    assert len(changed) >= 5, changed
    assert after[("kvstore_hits_total", ())] > before[("kvstore_hits_total", ())]
    assert after[("kvstore_tokens_served_total", (("tier", "ram"),))] > 0
    assert after[("kvstore_bytes", (("tier", "ram"),))] > 0


# ---------------------------------------------------------------------------
# vllm-mlx's own parity harness (tests/test_prefix_cache_scheduler_parity.py in
# its sdist), re-targeted at the store: a deterministic module whose logits
# depend on the sum of everything its cache holds, so KV served for the wrong
# prefix, or a token fed twice, changes the output.
# ---------------------------------------------------------------------------


class _Tokenizer:
    eos_token_id = 99
    clean_up_tokenization_spaces = False

    @staticmethod
    def encode(text, **_kwargs):
        return [int(t) for t in text.split()]

    @staticmethod
    def decode(tokens, **_kwargs):
        return "".join(chr(65 + int(t) % 26) for t in tokens)


class _CumulativeModel:
    """vllm-mlx's ``_CacheWritingModel`` (kv kind): next token = running sum of all tokens mod 8."""

    def __init__(self):
        import mlx.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = [object()]

            def make_cache(self):
                from mlx_lm.models.cache import KVCache
                return [KVCache()]

            def __call__(self, tokens, cache=None):
                import mlx.core as mx
                values = tokens.astype(mx.float32)
                layer = cache[0]
                prior = mx.zeros((values.shape[0], 1)) if layer.keys is None else \
                    mx.sum(layer.keys, axis=(1, 2, 3))[:, None]
                cumulative = prior + mx.cumsum(values, axis=1)
                kv = values[:, None, :, None]
                layer.update_and_fetch(kv, kv)
                selected = cumulative.astype(mx.int32) % 8
                return mx.where(mx.arange(8)[None, None, :] == selected[:, :, None], 10.0, -10.0)

        self.module = M()


def _step_until_done(scheduler, rid, prompt, max_tokens=3):
    from vllm_mlx.request import Request

    request = Request(request_id=rid, prompt=list(prompt),
                      sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    scheduler.add_request(request)
    out = []
    for _ in range(64):
        result = scheduler.step()
        for o in result.outputs:
            out.extend(o.new_token_ids)
        if rid in result.finished_request_ids:
            return out, request
    raise AssertionError(f"request {rid} did not finish")


def test_warm_equals_cold_on_random_prompt_families(tmp_path):
    """Prompts that repeat, extend (with the answer) or branch off earlier
    ones, through one scheduler on the store: each answer equals a cold
    scheduler's, and the store serves most prompt tokens."""
    import numpy as np

    model = _CumulativeModel().module
    rng = np.random.default_rng(7)
    config = SchedulerConfig(max_num_seqs=1, prefill_batch_size=1, completion_batch_size=1)
    history: list[list[int]] = []
    served = requested = 0
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=4, fetch_policy="always") as store, \
            V.install(store) as installed:
        warm = vllm_scheduler.Scheduler(model, _Tokenizer(), config)
        for i in range(24):
            pick = rng.integers(4) if history else 3
            base = history[rng.integers(len(history))] if history else []
            if pick == 0:
                prompt = list(base)  # an exact repeat
            elif pick == 1:
                prompt = base[: rng.integers(1, len(base) + 1)] + [int(t) for t in rng.integers(1, 9, 3)]  # a branch
            else:
                prompt = base + [int(t) for t in rng.integers(1, 9, rng.integers(2, 12))]  # an extension
            got, request = _step_until_done(warm, f"w{i}", prompt)
            installed.flush()
            cold = vllm_scheduler.Scheduler(model, _Tokenizer(), replace(config, enable_prefix_cache=False))
            want, _ = _step_until_done(cold, f"c{i}", prompt)
            assert got == want, f"request {i}: {prompt}"
            served += request.cached_tokens
            requested += len(prompt)
            history.append(prompt + got)
        installed.close()
    assert served > requested // 2



def test_simple_engine_prompt_trie_on_the_store(models, tmp_path):
    """vllm-mlx's SimpleEngine with --prefix-trie-cache (mlx-lm's LRUPromptCache
    there): the same answers as without it, and a repeat served from the store."""
    import asyncio

    from vllm_mlx.engine.simple import SimpleEngine

    path = models["llama"][0]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is two plus two?"}]

    async def answers(engine, n):
        await engine.start()
        out = []
        for _ in range(n):
            text = ""
            async for o in engine.stream_chat(messages=messages, max_tokens=8, temperature=0.0):
                text = o.text
            out.append(text)
        await engine.stop()
        return out

    plain = asyncio.run(answers(SimpleEngine(str(path)), 1))
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK) as store, \
            V.install(store, model_path=path) as installed:
        engine = SimpleEngine(str(path), prefix_trie_cache=True)
        ours = asyncio.run(answers(engine, 3))
        (trie,) = installed.caches
        assert isinstance(trie, V.StoreTrieCache)
        (cache,) = trie._caches.values()
        stats = cache.get_stats()
        installed.close()
    assert ours == plain * 3
    assert stats["hits"] == 2 and stats["misses"] == 1, stats
    assert stats["tokens_saved"] >= 2 * (stats["kvstore"]["tokens_requested"] // 3 - BLOCK)


def test_short_prompts_are_cached_too(models, tmp_path, prefills):
    """vllm-mlx's own cache skips prompts under 128 tokens; the store keeps a
    partial block as a leaf, so a short prompt repeated computes one token.
    (Served as ``"always"``: whether 16 tokens of a tiny model are worth a
    hit, 16 tokens of prefill against a fetch's fixed 0.5 ms, is for
    ``"auto"``'s calibration to say, and under ``"auto"`` the test once
    missed on CI.)"""
    path, model, tokenizer = models["llama"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                           tokenize=True)
    assert len(prompt) < min(BLOCK, 128)
    with PrefixStore(budget_gb=1, block_size=BLOCK, fetch_policy="always") as store, \
            V.install(store, model_path=path) as installed:
        eng = engine(model, tokenizer, "store")
        cold = generate(eng, prompt)
        installed.flush()
        assert generate(eng, prompt) == cold
        eng.close()
        installed.close()
    assert prefills.counts == [len(prompt), 1]


def test_installs_nest_and_each_uninstall_puts_back_what_it_replaced(tmp_path):
    builtin, init = vllm_scheduler.MemoryAwarePrefixCache, vllm_scheduler.Scheduler.__init__
    with PrefixStore(budget_gb=1) as one, PrefixStore(budget_gb=1) as two:
        with V.install(one):
            first = vllm_scheduler.MemoryAwarePrefixCache
            with V.install(two):
                assert vllm_scheduler.MemoryAwarePrefixCache is not first
            assert vllm_scheduler.MemoryAwarePrefixCache is first
        assert vllm_scheduler.MemoryAwarePrefixCache is builtin and vllm_scheduler.Scheduler.__init__ is init


def test_a_scheduler_built_while_installed_keeps_the_store_and_its_refresh_after_uninstall(models):
    """Non-trimmable caches are offered after every request (the store keeps
    only blocks it lacks): the scheduler's own setting, which outlives uninstall."""
    path, model, tokenizer = models["gemma3_text"]
    refresh = vllm_scheduler.Scheduler.SNAPSHOT_REFRESH_TOKENS
    with PrefixStore(budget_gb=1) as store:
        with V.install(store, model_path=path):
            eng = engine(model, tokenizer, "store")
        other = engine(model, tokenizer, "builtin")
        assert isinstance(eng.scheduler.memory_aware_cache, V.StorePrefixCache)
        assert eng.scheduler.SNAPSHOT_REFRESH_TOKENS == 0
        assert other.scheduler.SNAPSHOT_REFRESH_TOKENS == refresh > 0
        eng.close()
        other.close()


# ---------------------------------------------------------------------------
# One model folder, one key: kvstore vllm-mlx serve and kvstore generate (issue 51)
# ---------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": SYSTEM * 4}, {"role": "user", "content": "What is the weather like today?"}]


def _serve_once(model, store, tmp_path) -> dict:
    """One chat request (``MESSAGES``) to a fresh ``kvstore vllm-mlx serve`` on the store, stopped with SIGTERM
    (the store written out): the whole response. (``--fetch-policy always``: whether a hit is found, not whether
    its loading beats a prefill timed on a loaded machine.)"""
    server = Served(model, store, tmp_path / "serve.log", "--fetch-policy", "always")
    try:
        return _post(server.port, "/v1/chat/completions",
                     {"model": server.model, "max_tokens": 8, "temperature": 0, "messages": MESSAGES})
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("server_first", [True, False], ids=["server-then-generate", "generate-then-server"])
def test_a_prompt_stored_by_kvstore_vllm_mlx_serve_or_kvstore_generate_is_served_by_the_other(server_first,
                                                                                            tmp_path):
    """vllm-mlx's chat endpoint, like oMLX's, renders the template to text and tokenizes that with the special
    tokens (the tiny model's BOS twice): ``kvstore generate`` is given that text (``test_one_key.rendered_chat``)."""
    from .test_one_key import across_a_server

    model = make_tiny_model("llama", tmp_path / "tiny")
    across_a_server(lambda store: _serve_once(model, store, tmp_path), model, MESSAGES, tmp_path, BLOCK,
                    server_first)


# ---------------------------------------------------------------------------
# kvstore vllm-mlx serve: defaults on any model, cached tokens in usage
# ---------------------------------------------------------------------------


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _events(port: int, path: str, body: dict) -> list[dict]:
    """A streamed response's ``data:`` events, read to the end."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                out.append(json.loads(line[5:]))
    return out


def test_serve_with_its_defaults_starts_and_answers_on_a_105_token_vocabulary(tmp_path):
    """Issue 43: ``fetch_policy="auto"`` calibrates the model's prefill at
    start, and token ids made up past the vocabulary crashed the process."""
    from kvstore.adapters.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "small", vocab_size=105)
    log = tmp_path / "serve.log"
    server = Server([sys.executable, "-m", "kvstore.adapters.cli", "vllm-mlx", "serve", str(path),
                     "--ssd-path", str(tmp_path / "store")], log)
    try:
        body = {"model": server.model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello there, " * 40}]}
        first = _post(server.port, "/v1/chat/completions", body)
        again = _post(server.port, "/v1/chat/completions", body)
    finally:
        assert server.stop() == 0
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"] != ""
    assert re.search(r"timed [1-9]\d* prefills", log.read_text())  # calibrated (as many as its budget allows)


def test_serve_reports_the_store_hit_as_cached_tokens_in_every_api(models, tmp_path):
    """OpenAI chat completions, completions and responses, and Anthropic
    messages, streamed or not: the first request of a ~1,500-token prompt
    reports 0 cached tokens, its repeats what the store served."""
    path = models["llama"][0]
    server = Served(path, tmp_path / "store", tmp_path / "serve.log", "--fetch-policy", "always")
    system = SYSTEM * 4
    chat = {"model": server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is two plus two?"}]}
    text = {"model": server.model, "max_tokens": 4, "temperature": 0, "prompt": system}
    anthropic = {"model": server.model, "max_tokens": 4, "temperature": 0, "system": system,
                 "messages": [{"role": "user", "content": "What is two plus two?"}]}
    responses = {"model": server.model, "max_output_tokens": 4, "temperature": 0, "instructions": system,
                 "input": "What is two plus two?"}
    try:
        cold = _post(server.port, "/v1/chat/completions", chat)["usage"]
        warm = _post(server.port, "/v1/chat/completions", chat)["usage"]
        streamed = [e["usage"] for e in _events(server.port, "/v1/chat/completions",
                                                 {**chat, "stream_options": {"include_usage": True}})
                    if e.get("usage")]
        text_cold = _post(server.port, "/v1/completions", text)["usage"]
        text_warm = _post(server.port, "/v1/completions", text)["usage"]
        text_streamed = [e["usage"] for e in _events(server.port, "/v1/completions",
                                                      {**text, "stream_options": {"include_usage": True}})
                         if e.get("usage")]
        message = _post(server.port, "/v1/messages", anthropic)["usage"]
        events = _events(server.port, "/v1/messages", anthropic)
        response = _post(server.port, "/v1/responses", responses)["usage"]
        response_events = _events(server.port, "/v1/responses", responses)
    finally:
        server.kill()
    assert cold["prompt_tokens"] > 1400 and cold["prompt_tokens_details"] == {"cached_tokens": 0}
    assert warm["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"] - 1 >= 1400
    assert streamed[-1]["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"] - 1
    assert text_cold["prompt_tokens_details"] == {"cached_tokens": 1}  # its BOS, where the chat prompts start too
    assert text_warm["prompt_tokens_details"]["cached_tokens"] == text_warm["prompt_tokens"] - 1 >= 1400
    assert text_streamed[-1]["prompt_tokens_details"]["cached_tokens"] == text_warm["prompt_tokens"] - 1
    assert message["cache_read_input_tokens"] >= 1400 and message["input_tokens"] > message["cache_read_input_tokens"]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["usage"]["cache_read_input_tokens"] >= 1400
    assert response["input_tokens_details"]["cached_tokens"] >= 1400
    completed = next(e for e in response_events if e.get("type") == "response.completed")
    assert completed["response"]["usage"]["input_tokens_details"]["cached_tokens"] >= 1400


@pytest.mark.parametrize("kind", ["qwen3_next", "gemma3_text"])
def test_a_second_user_sharing_only_the_system_prompt_starts_from_the_store_on_hybrid_models(models, kind, tmp_path,
                                                                                          prefills):
    """Recurrent state (qwen3_next) and wrapped sliding windows (gemma3) cannot
    be cut back to a shorter prefix: the store computes a prompt's whole blocks
    at fetch, keeping a snapshot at each block boundary, so a second user who
    shares only a ~1,500-token system prompt starts from its last whole block.
    Every answer equals vllm-mlx's own (its built-in cache) at temperature 0."""
    path, model, tokenizer = models[kind]
    system = SYSTEM * 4

    def prompts_of(answer):
        users = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=True) for q in QUESTIONS[:2]]
        answer(users[0])
        return users

    builtin = run(model, tokenizer, "builtin", prompts_of)
    prefills.counts.clear()
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "store", block_size=BLOCK, fetch_policy="always") as store:
        ours = run(model, tokenizer, "store", prompts_of, store=store, path=path)
    assert ours == builtin
    users = prompts_of(lambda p: "")
    shared = next(i for i, (a, b) in enumerate(zip(*users)) if a != b)
    assert shared >= 1400
    served = len(users[1]) - prefills.counts[1]  # what the second user's request did not compute
    assert served >= shared // BLOCK * BLOCK >= 1000


def test_serve_a_hybrid_model_shares_a_system_prompt_between_users_with_vllm_mlx_own_answers(models, tmp_path):
    """``kvstore vllm-mlx serve`` on the tiny Qwen3-Next (recurrent state and
    attention): a second user sharing only a ~1,500-token system prompt is
    served its whole blocks from the store, and reports them in usage; every
    answer equals ``vllm-mlx serve``'s own."""
    from pathlib import Path

    path = models["qwen3_next"][0]
    vllm_mlx = str(Path(sys.executable).with_name("vllm-mlx"))
    answers, usages = {}, []
    for name, cmd in (("vllm-mlx", [vllm_mlx, "serve", str(path), "--continuous-batching"]),
                      ("kvstore", [sys.executable, "-m", "kvstore.adapters.cli", "vllm-mlx", "serve", str(path),
                                   "--ssd-path", str(tmp_path / "store"), "--block-size", str(BLOCK),
                                   "--fetch-policy", "always"])):
        server = Server(cmd, tmp_path / f"{name}.log")
        try:
            out = []
            for question in QUESTIONS[:2]:
                body = {"model": server.model, "max_tokens": 8, "temperature": 0,
                        "messages": [{"role": "system", "content": SYSTEM * 4}, {"role": "user", "content": question}]}
                got = _post(server.port, "/v1/chat/completions", body)
                out.append(got["choices"][0]["message"]["content"])
                usages.append(got["usage"])
            answers[name] = out
        finally:
            server.kill()
    assert answers["kvstore"] == answers["vllm-mlx"]
    first, second = usages[2:]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"]["cached_tokens"] >= 1000
