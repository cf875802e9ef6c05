"""Cost-aware fetch: a hit is served only as far as loading beats recomputing.

Rates here are made up on purpose (fed through the same ``observe_*`` calls
the store and the adapters make), so each case pins one decision."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import ConfigError, PrefixStore
from kvstore.cost.model import STATES, CostModel, PrefillModel

from ._helpers import assert_hit_is, kv_layers

GB = 1e9
M = "cost-model"
BS = 8


def _fast_prefill(cost: CostModel, model: str = "m", tok_per_s: float = 1e6) -> None:
    for n in (100, 1000, 4000, 8000):
        cost.observe_prefill(model, 0, n, 1e-4 + n / tok_per_s)


def test_prefill_model_fit_recovers_fixed_linear_and_context_terms():
    truth = PrefillModel(0.01, 1e-4, 2e-9)
    obs = [(s, e, truth.seconds(s, e)) for s, e in ((0, 100), (0, 2000), (1000, 5000), (0, 8000), (4000, 4100))]
    fit = PrefillModel.fit(obs)
    for s, e, t in obs:
        assert fit.seconds(s, e) == pytest.approx(t, rel=1e-6)
    assert fit.c == pytest.approx(2e-9, rel=1e-3)


def test_a_slow_first_request_does_not_skew_the_prefill_model():
    """A warm-up request (kernels compiled, 10x slow) is left out of the fit:
    the model still predicts the steady prefill time."""
    truth = PrefillModel(0.02, 0.0, 3e-9)
    obs = [(0, 32768, 10 * truth.seconds(0, 32768))]
    obs += [(0, n, truth.seconds(0, n) * f) for n, f in ((32768, 1.02), (32768, 0.97), (8192, 1.0), (2048, 1.03))]
    fit = PrefillModel.fit(obs)
    assert fit.seconds(0, 32768) == pytest.approx(truth.seconds(0, 32768), rel=0.05)


def test_with_the_models_shape_short_calibration_prefills_predict_long_ones():
    """An 8B llama's shape (attention multiply-adds per token of context over
    weight multiply-adds per token: 32 layers x 32 heads x 128 x 2 / 7.5e9)
    ties the context term to the per-token one: prefills of at most 1K tokens,
    where attention is 2% of the time and noise hides it, then predict a 32K
    prefill; the free three-term fit misses it."""
    ratio = 32 * 32 * 128 * 2 / 7.5e9
    truth = PrefillModel(0.004, 32e-6, ratio * 32e-6)  # about an 8B prefill on an H200: 32K in 1.6 s
    noise = (1.03, 0.98, 1.02, 0.97)
    obs = [(s, e, truth.seconds(s, e) * f) for (s, e), f in zip(((0, 128), (0, 512), (0, 1024), (512, 1024)), noise)]
    tied, free = PrefillModel.fit(obs, ratio), PrefillModel.fit(obs)
    assert tied.c == pytest.approx(ratio * tied.b)
    assert tied.seconds(0, 32768) == pytest.approx(truth.seconds(0, 32768), rel=0.08)
    assert abs(free.seconds(0, 32768) / truth.seconds(0, 32768) - 1) > 0.15
    # what the store is told goes into the model it plans with (and a bad ratio is ignored)
    cost = CostModel()
    for o in obs:
        cost.observe_prefill("m", *o)
    cost.set_context_ratio("m", float("nan"))
    assert cost.prefill_model("m").c == free.c
    cost.set_context_ratio("m", ratio)
    assert cost.prefill_model("m").seconds(0, 32768) == pytest.approx(tied.seconds(0, 32768))


def test_prefill_fit_never_goes_negative():
    """Noisy observations that a plain least-squares fit would explain with a
    negative term still give a model that never predicts negative time."""
    fit = PrefillModel.fit([(0, 100, 0.05), (0, 200, 0.04), (0, 4000, 0.5), (0, 8000, 0.9)])
    assert min(fit.a, fit.b, fit.c) >= 0
    assert all(fit.seconds(0, n) > 0 for n in (1, 100, 10_000))


def test_a_slow_tier_is_skipped():
    cost = CostModel()
    _fast_prefill(cost)  # 1M tokens/s
    cost.observe_load("ssd_cold", 1 * GB, 10.0)  # 0.1 GB/s
    plan = cost.plan("m", 4000, [0, 2000], [2000, 3999], [int(0.5 * GB), int(0.5 * GB)],
                     ["ssd_cold", "ssd_cold"], 3999)
    assert plan.length == 0 and plan.skipped == 3999
    assert "recomputing is faster" in plan.reason


def test_a_fast_tier_is_served():
    cost = CostModel()
    _fast_prefill(cost, tok_per_s=1e4)
    cost.observe_load("ram", 10 * GB, 1.0)
    plan = cost.plan("m", 4000, [0, 2000], [2000, 3999], [10_000_000] * 2, ["ram", "ram"], 3999)
    assert plan.length == 3999 and plan.skipped == 0 and plan.reason == ""
    assert plan.load_s < cost.prefill_model("m").seconds(0, 4000)


def test_a_mixed_path_splits_where_the_slow_tier_starts():
    cost = CostModel()
    _fast_prefill(cost, tok_per_s=1e5)
    cost.observe_load("ram", 10 * GB, 1.0)
    cost.observe_load("ssd_cold", 1 * GB, 20.0)
    plan = cost.plan("m", 4000, [0, 2000], [2000, 3999], [100_000_000] * 2, ["ram", "ssd_cold"], 3999)
    assert plan.length == 2000 and plan.skipped == 1999
    assert "past token 2000" in plan.reason


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 10**9), st.sampled_from(STATES)),
                       min_size=1, max_size=40),
       extra=st.integers(1, 500), short=st.integers(0, 299), speed=st.floats(1e3, 1e7),
       ram_gbps=st.floats(0.1, 100.0))
def test_the_plan_loads_the_prefix_whose_load_and_prefill_are_predicted_cheapest(blocks, extra, short, speed,
                                                                                 ram_gbps):
    """Over every block boundary (and none, and all): the chosen length's
    predicted load plus the rest's predicted prefill is the least, unless it
    saves under the margin of recomputing it all (then nothing is loaded)."""
    cost = CostModel()
    _fast_prefill(cost, tok_per_s=speed)
    for state, gbps in zip(STATES, (ram_gbps, ram_gbps / 4, ram_gbps / 40)):
        cost.observe_load(state, int(gbps * GB), 1.0)
    starts, ends, pos = [], [], 0
    for n, _, _ in blocks:
        starts.append(pos)
        pos += n
        ends.append(pos)
    servable, n_prompt = pos - min(short, blocks[-1][0] - 1), pos + extra  # the last block servable in part
    sizes, states = [b for _, b, _ in blocks], [s for _, _, s in blocks]
    plan = cost.plan("m", n_prompt, starts, ends, sizes, states, servable)
    pm, rate = cost.prefill_model("m"), {s: r.bytes_per_s for s, r in cost.rates.items()}

    def total(n: int) -> float:  # whole blocks before the one holding token n-1, and its share
        if n == 0:
            return pm.seconds(0, n_prompt)
        i = next(k for k, e in enumerate(ends) if e >= n)
        load = cost.fixed_s + sum(sizes[k] / rate[states[k]] for k in range(i))
        load += sizes[i] / rate[states[i]] * (n - starts[i]) / (ends[i] - starts[i])
        return load + pm.seconds(n, n_prompt)

    cuts = sorted({0, servable} | {min(e, servable) for e in ends})
    best = min(total(n) for n in cuts)
    if plan.length == 0:
        assert plan.prefill_s == pytest.approx(pm.seconds(0, n_prompt))
        assert best >= total(0) * (1 - cost.margin) - 1e-12  # no cut saves the margin
    else:
        assert plan.length in cuts
        assert total(plan.length) == pytest.approx(best, rel=1e-9)
        assert best <= total(0) * (1 - cost.margin) * (1 + 1e-9)  # and it saves the margin
        assert plan.load_s + plan.prefill_s == pytest.approx(total(plan.length), rel=1e-9)


def test_a_near_tie_is_not_served():
    """A hit predicted to save under ``margin`` (5%) of recomputing is
    declined, whole: the rates are estimates and a hit has costs they do not
    model. Here the first block of an otherwise cold prompt is page-cached and
    predicted to save 1% (on the H200 such a hit took longer than recomputing
    it all); half the prompt cached saves half, and is served."""
    cost = CostModel()
    _fast_prefill(cost, tok_per_s=1e5)  # 4000 tokens: 40 ms
    cost.observe_load("ssd_cached", 10 * GB, 1.0)
    cost.observe_load("ssd_cold", 1 * GB, 20.0)
    first = ("m", 4000, [0, 100], [100, 3999], [1_000_000, 100_000_000], ["ssd_cached", "ssd_cold"], 3999)
    plan = cost.plan(*first)
    assert plan.length == 0 and "not worth a hit" in plan.reason
    assert replace(cost, margin=0.0).plan(*first).length == 100
    half = cost.plan("m", 4000, [0, 2000], [2000, 3999], [1_000_000, 100_000_000], ["ssd_cached", "ssd_cold"], 3999)
    assert half.length == 2000
    # where only the whole prefix is servable (a state snapshot at its end), the margin weighs that alone
    whole = ("m", 4000, [0, 2000], [2000, 3999], [1_000_000, 1_000_000], ["ssd_cached", "ssd_cold"], 3999)
    assert cost.plan(*whole, limit_to=lambda n: 0 if n < 3999 else 3999).length == 3999
    assert replace(cost, margin=0.99).plan(*whole, limit_to=lambda n: 0 if n < 3999 else 3999).length == 0


def test_a_near_tie_declined_on_assumed_rates_says_so():
    cost = CostModel()
    _fast_prefill(cost, tok_per_s=1e5)
    cost.assume("ssd_cached", 10 * GB)  # a prior (probe), not a measurement
    cost.assume("ssd_cold", 0.05 * GB)
    plan = cost.plan("m", 4000, [0, 100], [100, 3999], [1_000_000, 100_000_000], ["ssd_cached", "ssd_cold"], 3999)
    assert plan.length == 0 and "not worth a hit" in plan.reason and "assumed" in plan.reason


def test_policies_always_and_never_and_unmeasured_rates():
    cost = CostModel("always")
    assert cost.plan("m", 100, [0], [99], [1], ["ssd_cold"], 99).length == 99
    cost = CostModel("never")
    assert cost.plan("m", 100, [0], [99], [1], ["ram"], 99).length == 0
    cost = CostModel()  # nothing measured: serve everything, and say why
    plan = cost.plan("m", 100, [0], [99], [1], ["ram"], 99)
    assert plan.length == 99 and "not measured" in plan.reason
    with pytest.raises(ConfigError, match="fetch_policy"):
        CostModel("sometimes")


def test_a_servable_limit_is_respected():
    """Where only some lengths are servable (a state snapshot at block ends), the
    plan cuts where the store can serve."""
    cost = CostModel()
    _fast_prefill(cost, tok_per_s=1e5)
    cost.observe_load("ram", 10 * GB, 1.0)
    cost.observe_load("ssd_cold", 1 * GB, 20.0)
    plan = cost.plan("m", 4000, [0, 2000], [2000, 3999], [100_000_000] * 2, ["ram", "ssd_cold"], 3999,
                     limit_to=lambda n: 0 if n < 3999 else 3999)  # e.g. the only snapshot is at the end
    assert plan.length in (0, 3999)


def _prompt(n, start=10):
    return list(range(start, start + n))


def test_store_skips_by_cost_reports_it_and_keeps_rates_across_restart(tmp_path):
    path = tmp_path / "store"
    p = _prompt(64)
    with PrefixStore(ssd_path=path, block_size=BS) as store:
        store.put(M, p, kv_layers(p))
        store.flush()
        assert store.fetch(M, p).length == 64  # nothing measured about prefill: served
        for n in (100, 1000, 4000, 8000):  # an engine that prefills 1e9 tokens/s
            store.observe_prefill(M, 0, n, n * 1e-9)
        hit = store.fetch(M, p)
        assert hit.length == 0 and hit.skipped_tokens == 64 and "recomputing" in hit.skip_reason
        st = store.stats()
        assert st["tokens_skipped_cost"] == 64
        assert st["cost"]["rates"]["ram"]["observed"] >= 1
        assert next(iter(st["cost"]["prefill"].values()))["observed"] == 4
    with PrefixStore(ssd_path=path, block_size=BS) as again:
        learned = again.stats()["cost"]  # before any fetch: what the last run measured came back from disk
        assert learned["rates"]["ram"]["observed"] >= 1
        assert next(iter(learned["prefill"].values()))["observed"] == 4
        first = again.fetch(M, p)  # from SSD, a tier not measured yet on this machine: its prior decides
        assert first.length == 0 and "rates assumed, not measured yet: ssd_" in first.skip_reason
        assert any(r["prior"] for s, r in again.stats()["cost"]["rates"].items() if s.startswith("ssd_"))
    with PrefixStore(ssd_path=path, block_size=BS, fetch_policy="always") as forced:
        assert forced.fetch(M, p).length == 64


def test_a_hit_timed_to_the_first_token_corrects_the_load_rate(tmp_path):
    """The store times its fetch to arrays; on a GPU the arrays then still move
    to the device inside the engine's first forward. An adapter's report of the
    whole request charges what the prefill model does not explain to the load,
    and from then on the store's own (too cheap) timings of that source no
    longer count: an expensive hit is then declined."""
    p = _prompt(64)
    with PrefixStore(ssd_path=tmp_path / "store", block_size=BS, prior_ram_gbps=100.0) as store:
        store.put(M, p, kv_layers(p))
        store.flush()
        for n in (100, 1000, 4000):  # cold requests: 10K tokens/s
            store.observe_request(M, n, None, n * 1e-4)
        hit = store.fetch(M, p, limit=63)
        assert hit.length == 63 and hit.source_bytes["ram"] > 0  # the fetch alone looks cheap: served
        store.observe_request(M, 64, hit, 1.0)  # but the engine waited a second for its first token
        rate = store.stats()["cost"]["rates"]["ram"]
        assert rate["gb_per_s"] < hit.source_bytes["ram"] / 0.9 / 1e9
        again = store.fetch(M, p, limit=63)  # timed cheap again by the store: does not count any more
        assert again.length == 0 and again.skipped_tokens == 63


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("read_bytes"))


def _dropped(data) -> bool:
    """Drop a file from the page cache; False where that does not work (tmpfs, no /proc)."""
    import mmap
    import os

    from kvstore.tiers.disk.residency import address, resident_at

    fd = os.open(data, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            try:
                return (resident_at(address(view), len(view)) or 1.0) < 0.5
            finally:
                view.release()
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def test_the_residency_check_reads_nothing_and_tells_cold_from_cached(tmp_path):
    """Deciding whether disk blocks are page-cached reads none of them (asking
    LMDB for a value would read it all), so a cold store looks cold, a warm
    one warm, and a hit declined by the policy costs no disk reads."""
    import os

    p = _prompt(8 * 256)
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "s", block_size=256) as s:
        s.put("m", p, kv_layers(p, n_layers=4, heads=8, dim=128))  # 8 blocks of 4 MiB
    if not os.path.exists("/proc/self/io") or not _dropped(tmp_path / "s" / "data.mdb"):
        pytest.skip("the page cache cannot be dropped or watched here")
    with PrefixStore(budget_gb=0, ssd_path=tmp_path / "s", block_size=256, fetch_policy="never") as s:
        before = _read_bytes()
        assert not s.fetch("m", p)
        assert _read_bytes() - before < 4 << 20  # not one block, let alone the 32 MiB of them
        s.fetch_policy = "always"
        hit = s.fetch("m", p)  # cold blocks read ahead on several threads, then gathered
        assert hit.ssd_tokens == len(p)
        assert_hit_is(hit, p, len(p), n_layers=4, heads=8, dim=128)
        cold = s.stats()["cost"]["rates"]
        # (opening reads the index, and the kernel's readahead around it may bring in some blocks)
        assert cold.get("ssd_cold", {}).get("observed", 0) == 1
        assert s.fetch("m", p).ssd_tokens == len(p)
        warm = s.stats()["cost"]["rates"]
        assert warm["ssd_cold"]["observed"] == 1
        assert warm["ssd_cached"]["observed"] == cold.get("ssd_cached", {}).get("observed", 0) + 1


def test_blocks_without_a_recorded_offset_teach_no_rate_until_read_once(tmp_path):
    """A block whose place in the file is unknown (written before offsets were
    recorded, or without writemap) is planned as cold but its fetch is not
    charged to a rate it may not belong to; reading it once records where it
    is, and from then on its residency is known."""
    import lmdb

    from kvstore.blocks.record import BlockRecord

    p = _prompt(4 * 64)
    with PrefixStore(budget_gb=1, ssd_path=tmp_path / "s", block_size=64) as s:
        s.put("m", p, kv_layers(p, n_layers=2, heads=2, dim=64))
    env = lmdb.open(str(tmp_path / "s"), max_dbs=8)  # as an older kvstore left it: records without offsets
    nodes = env.open_db(b"nodes")
    with env.begin(write=True) as txn:
        for key, raw in list(txn.cursor(db=nodes)):
            rec = BlockRecord.unpack(key, raw)
            txn.put(key, replace(rec, offset=-1).pack(), db=nodes)
    env.close()
    with PrefixStore(budget_gb=0, ssd_path=tmp_path / "s", block_size=64, fetch_policy="always") as s:
        assert s.fetch("m", p).ssd_tokens == len(p)
        # nothing learnt from blocks of unknown residency (the priors are those the first open probed)
        assert not any(r["observed"] for r in s.stats()["cost"]["rates"].values())
        assert s.fetch("m", p).ssd_tokens == len(p)
        assert s.stats()["cost"]["rates"]["ssd_cached"]["observed"] == 1  # offsets learnt on the first read


def test_a_prior_stands_in_for_a_rate_until_measured_and_decides_alike():
    """A prior decides as a measured rate of the same value would (one rule),
    and the first measurement replaces it."""
    measured, assumed = CostModel(), CostModel()
    for cost in (measured, assumed):
        _fast_prefill(cost, tok_per_s=1e4)
    measured.observe_load("ssd_cold", 1 * GB, 10.0)
    assumed.assume("ssd_cold", 0.1 * GB)
    args = ("m", 4000, [0, 2000], [2000, 3999], [int(0.5 * GB)] * 2, ["ssd_cold"] * 2, 3999)
    a, m = assumed.plan(*args), measured.plan(*args)
    assert a.length == m.length == 0 and "assumed" in a.reason and "assumed" not in m.reason
    assumed.observe_load("ssd_cold", 100 * GB, 1.0)  # measured: far faster than the prior said
    assert assumed.describe()["rates"]["ssd_cold"] == {"gb_per_s": 100.0, "observed": 1, "prior": False}
    assert assumed.plan(*args).length == 3999


def test_priors_are_probed_at_open_kept_per_machine_and_not_when_told(tmp_path):
    p = _prompt(64)
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS) as store:
        store.put(M, p, kv_layers(p))
        rates = store.stats()["cost"]["rates"]
        assert set(rates) == {"ram", "ssd_cached", "ssd_cold"} and all(r["prior"] for r in rates.values())
        assert all(r["gb_per_s"] > 0 for r in rates.values())
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS, prior_ram_gbps=123.0) as again:
        assert again.stats()["cost"]["rates"] == rates  # what the first open probed, not re-probed or configured
    with PrefixStore(ssd_path=tmp_path / "s", block_size=BS, prior_ram_gbps=123.0, remember_rates=False) as fresh:
        assert fresh.stats()["cost"]["rates"]["ram"]["gb_per_s"] == 123.0
    with PrefixStore(block_size=BS, fetch_policy="never") as never:  # no prior where nothing will weigh it
        assert never.stats()["cost"]["rates"] == {}


def test_the_first_request_through_generate_declines_a_losing_ssd_hit_and_serves_a_winning_ram_hit(tmp_path):
    """An empty store and a model it never saw: ``generate`` under auto first
    times a few prefills of the model (``calibrate_once``), and the load-rate
    priors decide the first hit. They are set through ``StoreConfig`` here, so
    that the outcome is by construction: a disk far slower than any prefill, RAM
    far faster."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.adapters.generate import generate, model_key, store_cache
    from kvstore.adapters.tiny_models import make_tiny_model

    model, tokenizer = load(str(make_tiny_model("llama", tmp_path / "model")))
    key, p = model_key(model), _prompt(256)
    cache = make_prompt_cache(model)  # the prompt's KV made outside generate: no prefill observed
    model(mx.array(p)[None], cache=cache)
    mx.eval([c.state for c in cache])
    # (a calibration budget that times enough lengths to fit on a loaded 2-core box too: with fewer the first
    # hit is served unweighed)
    priors = dict(block_size=64, remember_rates=False, prior_ram_gbps=1000.0, prior_ssd_cached_gbps=1e-6,
                  prior_ssd_cold_gbps=1e-6, calibrate_budget_s=10.0)
    with PrefixStore(ssd_path=tmp_path / "s", fetch_policy="never", **priors) as s:
        store_cache(s, key, p, cache)
    with PrefixStore(budget_gb=0, ssd_path=tmp_path / "s", **priors) as s:
        assert s.stats()["cost"]["prefill"] == {}
        r = generate(model, tokenizer, p, store=s, max_tokens=1)
        assert r.cached_tokens == 0 and s.stats()["tokens_skipped_cost"] == 255
        assert r.calibrate_s > 0 and 0 < r.ttft_s
        # the model's shape ties the context term to the per-token one: multiply-adds of attention per token of
        # context (2 layers x 1 head x 64 x 2) over those of the weights (2 x 131,072 + the 128 x 1,024 head)
        a = model.args
        assert (a.num_hidden_layers, a.num_attention_heads, a.head_dim, a.hidden_size) == (2, 1, 64, 128)
        fit = next(iter(s.stats()["cost"]["prefill"].values()))
        assert fit["s_per_token_context"] == pytest.approx(fit["s_per_token"] * 256 / 393_216)
    with PrefixStore(budget_gb=1, **priors) as s:  # RAM only
        store_cache(s, key, p, cache)
        s.flush()
        r = generate(model, tokenizer, p, store=s, max_tokens=1)
        assert r.cached_tokens == 255 and r.ram_tokens == 255 and s.stats()["tokens_skipped_cost"] == 0
        assert r.calibrate_s > 0
        again = generate(model, tokenizer, p, store=s, max_tokens=1)
        # calibrated once per model and store (whether it serves again depends on what the first hit measured:
        # one end-to-end timing, which a stall of this machine can make look slow)
        assert again.calibrate_s == 0


def test_calibration_reports_each_length_without_the_processs_first_run_of_it(tmp_path):
    """A process's first prefill of a length compiles kernels for it (on CUDA
    3-10x the next one). ``calibrate`` times each length twice and reports
    the faster: a model whose every first call of a length stalls 1.5 s still
    gets its steady prefill times into the store."""
    import time

    from mlx_lm import load

    from kvstore.adapters.generate import calibrate, model_key
    from kvstore.adapters.tiny_models import make_tiny_model

    model, _ = load(str(make_tiny_model("llama", tmp_path / "model")))
    stall, seen = 1.5, set()
    steady = type(model).__call__

    class FirstOfALengthStalls(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            if inputs.shape[-1] not in seen:  # as compiling this length's kernels would
                seen.add(inputs.shape[-1])
                time.sleep(stall)
            return steady(self, inputs, *args, **kwargs)

    model.__class__ = FirstOfALengthStalls
    with PrefixStore(fetch_policy="auto", remember_rates=False) as s:
        reported: list[tuple[int, int, float]] = []
        told = s.observe_prefill
        s.observe_prefill = lambda key, start, stop, secs: (reported.append((start, stop, secs)),
                                                            told(key, start, stop, secs))
        calibrate(s, model_key(model), [model], sizes=((0, 64), (0, 128), (64, 128)), budget_s=60)
    assert [(a, b) for a, b, _ in reported] == [(0, 64), (0, 128), (64, 128)]
    assert {63, 127} <= seen  # generate_step prefilled these lengths (the last token goes alone): each stalled once
    assert all(secs < stall for _, _, secs in reported), reported
