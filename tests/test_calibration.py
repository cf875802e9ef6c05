"""Calibration under ``fetch_policy="auto"`` (adapters/calibration.py): a
model's first request never waits long for it (issue 41: 726 s of SmolLM2's
first request on a CPU), it says what it does, it can be skipped, and the
token ids it makes up are ones the model can embed (issue 43: a 105-token
vocabulary crashed mlx's CPU backend on ids up to 1000).

The slow models here are real tiny models whose forward passes also sleep a
fixed time per token, so what a budget allows is known in advance, not a
race with the machine's load."""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.utils import _get_classes

from kvstore import ConfigError, PrefixStore
from kvstore.adapters.calibration import LADDER, calibrate, calibrate_once, vocab_size
from kvstore.adapters.generate import calibrate_at_load, generate, model_key, store_cache
from kvstore.adapters.tiny_models import make_tiny_model, model_config

PER_TOKEN_S = 0.02


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(make_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama")))


def _slowed(model, per_token_s: float = PER_TOKEN_S, seen: list | None = None):
    """``model`` as a slow device runs it: each forward sleeps ``per_token_s`` a token
    (and, with ``seen``, records the largest id it was given)."""
    steady = type(model).__call__

    class Slow(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            if seen is not None:
                seen.append(int(mx.max(inputs).item()))
            time.sleep(per_token_s * inputs.shape[-1])
            return steady(self, inputs, *args, **kwargs)

    model.__class__ = Slow
    return model


def test_calibration_times_short_prefills_only_on_a_slow_device_and_keeps_to_its_budget(tmp_path):
    """At 20 ms a token, 4 tokens (twice) take 0.16 s, 32 would take 1.28 s
    more and 256 10 s: a 0.5 s budget times the first size only, a 5 s one
    the first two, and neither starts a prefill it predicts past the budget
    (which sizes it starts is what keeps it to the budget: no wall-clock bound here).
    (5 s, not 3: a CI run on a loaded 2-core box once stalled the first
    prefills by over a second, and a 3 s budget then declined the second size.)"""
    model, _ = load(str(make_tiny_model("llama", tmp_path / "m")))
    with PrefixStore(remember_rates=False) as s:  # the process's first prefills (kernels built) before it is slowed
        calibrate(s, "warm-up", [model], budget_s=60, sizes=LADDER[:2])
    model = _slowed(model)
    for budget, sizes in ((0.5, [(0, 4)]), (5.0, [(0, 4), (0, 32)])):
        with PrefixStore(remember_rates=False) as s:
            got = calibrate(s, model_key(model), [model], budget_s=budget)
            assert [(a, b) for a, b, _ in got.timed] == sizes == list(LADDER[:len(sizes)])
            assert all(secs >= PER_TOKEN_S * (b - a) for a, b, secs in got.timed)
            assert [m["observed"] for m in s.stats()["cost"]["prefill"].values()] == [len(sizes)]


def test_a_fast_model_is_timed_up_the_ladder_and_fitted(tiny):
    """Where prefills are cheap the ladder goes on (here up to 2K tokens),
    enough for the store to fit a model."""
    model, _ = tiny
    with PrefixStore(remember_rates=False) as s:
        got = calibrate(s, model_key(model), [model], budget_s=60, sizes=LADDER[:4])
        assert [(a, b) for a, b, _ in got.timed] == list(LADDER[:4])
        assert s.knows_prefill(model_key(model))


def test_the_first_request_logs_the_calibration_and_a_zero_budget_skips_it(tiny, caplog):
    """One line when calibration starts (what, how long at most, how to skip
    it) and one when it ends; ``calibrate_budget_s=0`` skips it, and auto then
    serves the model's hits (a prefill it has not timed is not weighed)."""
    model, tokenizer = tiny
    key, prompt = model_key(model), list(range(5, 200))
    caplog.set_level(logging.INFO, logger="kvstore")
    with PrefixStore(remember_rates=False) as s:
        r = generate(model, tokenizer, prompt, store=s, max_tokens=1)
        assert r.calibrate_s > 0  # (timed; how long is the budget's business: the sizes it starts, above)
    start, end = [rec.getMessage() for rec in caplog.records if rec.name == "kvstore.calibrate"]
    assert "within a budget of 3.0 s" in start and "at most" not in start  # a budget, not a promised bound
    assert "calibrate_budget_s=0" in start and "fetch_policy='always'" in start
    assert end.startswith("kvstore: timed ") and "prefills of model" in end
    caplog.clear()
    with PrefixStore(remember_rates=False, calibrate_budget_s=0) as s:
        store_cache(s, key, prompt, _cache_of(model, prompt))
        r = generate(model, tokenizer, prompt, store=s, max_tokens=1)
        assert r.calibrate_s == 0 and r.cached_tokens == len(prompt) - 1
        assert s.stats()["cost"]["prefill"] == {}
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "kvstore.calibrate"]
    assert "not calibrated (calibrate_budget_s=0)" in line


def test_a_model_too_slow_to_fit_is_calibrated_once_and_its_hits_are_served(tmp_path):
    """Where the budget times fewer prefills than a fit needs, the model is
    not calibrated again at each request, and its hits are served."""
    model, tokenizer = load(str(make_tiny_model("llama", tmp_path / "m")))
    key, prompt = model_key(model), list(range(5, 40))
    cache = _cache_of(model, prompt)
    model = _slowed(model, 0.05)
    with PrefixStore(remember_rates=False, calibrate_budget_s=0.2) as s:
        store_cache(s, key, prompt, cache)
        first = generate(model, tokenizer, prompt, store=s, max_tokens=1)
        assert 0 < first.calibrate_s and not s.knows_prefill(key)
        assert first.cached_tokens == len(prompt) - 1
        assert calibrate_once(s, key, [model]) == 0.0


def test_calibrating_at_load_leaves_the_first_request_nothing_to_wait_for(tiny):
    """``kvstore generate`` calibrates once the model is loaded, before the
    prompt: the first request then times nothing (``calibrate_s`` 0)."""
    model, tokenizer = tiny
    with PrefixStore(remember_rates=False) as s:
        assert calibrate_at_load(s, model) > 0
        observed = [m["observed"] for m in s.stats()["cost"]["prefill"].values()]
        assert len(observed) == 1 and observed[0] >= 1
        r = generate(model, tokenizer, list(range(5, 60)), store=s, max_tokens=1)
        assert r.calibrate_s == 0 and r.prompt_tokens == 55
        assert calibrate_at_load(s, model) == 0


def test_a_calibration_past_its_budget_says_so(tmp_path, caplog):
    """The first prefill is always timed: at 20 ms a token its 4 tokens take
    80 ms, past a 50 ms budget, and the end line says the budget was passed
    (no bound is promised that is not kept)."""
    model, _ = load(str(make_tiny_model("llama", tmp_path / "m")))
    model = _slowed(model)
    caplog.set_level(logging.INFO, logger="kvstore")
    with PrefixStore(remember_rates=False, calibrate_budget_s=0.05) as s:
        assert calibrate_once(s, model_key(model), [model]) > 0.05
    end = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvstore: timed ")]
    assert len(end) == 1 and "past the 0.05 s budget" in end[0] and "(4 tokens)" in end[0]


def test_calibration_draws_token_ids_from_the_models_vocabulary():
    """A model of 105 tokens (issue 43: ids up to 1000 read past its
    embedding, a SIGSEGV on mlx's CPU backend) is calibrated on ids below 105."""
    config = model_config("llama", vocab_size=105)
    model_cls, args_cls = _get_classes(config)
    seen: list[int] = []
    model = _slowed(model_cls(args_cls.from_dict(config)), 0.0, seen)
    mx.eval(model.parameters())
    assert vocab_size([model]) == 105
    with PrefixStore(remember_rates=False) as s:
        got = calibrate(s, "small-vocabulary", [model], budget_s=60, sizes=LADDER[:3])
    assert len(got.timed) == 3 and seen and max(seen) < 105


def test_calibrate_budget_is_checked():
    with pytest.raises(ConfigError, match="calibrate_budget_s"):
        PrefixStore(calibrate_budget_s=-1)


def _cache_of(model, prompt):
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache
