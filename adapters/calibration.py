"""Calibration: a few timed prefills of a model, so ``fetch_policy="auto"``
can weigh a hit against recomputing it before any real request has been timed.

It runs once per model and store in a process (``calibrate_once``), where an
engine's own prefills cannot be timed (mlx-lm's server, vllm-mlx), at load:
``kvstore serve`` before its port answers, ``kvstore generate`` before the
prompt (a request that waited on it took 3.5x mlx-lm's first; one served
beside it would also skew its timings). It starts at 4 tokens and times the
next, longer prefill only while the time that one is predicted to take (from
what the last ones took) fits what is left of ``StoreConfig.calibrate_budget_s``
(default 3 s; 0 skips it): a budget, not a bound (a prefill slower than
predicted runs past it, and the log says so). A GPU reaches
the 4K-8K prefills it is best fitted to; a slow CPU model times a few short
ones and stops. Where that leaves fewer prefills than a fit needs, hits are
served (right where prefill is slow) and the engine's own cold prefills, which
the adapters report, complete the fit. One log line (logger ``kvstore``) says
when it starts and what it did. What it costs: docs/benchmarks.md, calibration.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as C

from kvstore import PrefixStore

__all__ = ["Calibration", "calibrate", "calibrate_once", "context_ratio", "random_tokens", "vocab_size", "LADDER"]

log = logging.getLogger("kvstore.calibrate")

# (cached, total) tokens of each timed prefill, in the order tried: 8x steps, few lengths (on CUDA a process's
# first prefill of a length compiles kernels, ~0.4 s for an 8B model: docs/benchmarks.md, cost), so a GPU
# reaches 8K, what its prefill model is best fitted to, within the budget. The last times a prefill after a hit.
LADDER: tuple[tuple[int, int], ...] = ((0, 4), (0, 32), (0, 256), (0, 2048), (0, 8192), (4096, 8192))
_MIN_FIT = 3  # prefills the store needs before it trusts a fit (``cost._MIN_OBS``)


@dataclass
class Calibration:
    """What ``calibrate`` did: the prefills it reported, ``(cached, total,
    seconds)``, and the wall time it took (set-up and second runs included)."""

    timed: list[tuple[int, int, float]] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""  # why nothing was timed, where nothing was


def vocab_size(models: Sequence[nn.Module]) -> Optional[int]:
    """The ids every one of ``models`` can embed: the smallest of their
    configured vocabulary sizes and embedding tables' rows (``None`` where
    neither can be read). An id past an embedding's rows is read out of
    bounds on mlx's CPU backend (a crash, not an error)."""
    sizes = []
    for m in models:
        v = getattr(getattr(m, "args", None), "vocab_size", None)
        if isinstance(v, int) and v > 0:
            sizes.append(v)
        for _, mod in tree_flatten(m.leaf_modules(), is_leaf=lambda x: isinstance(x, nn.Module)):
            if isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding)):
                sizes.append(int(mod.weight.shape[0]))
    return min(sizes) if sizes else None


def random_tokens(vocab: int, n: int) -> mx.array:
    """``n`` token ids drawn from ``[0, vocab)`` (a fixed key: the caller's seed is left alone)."""
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(n))


def _prefill_s(m: nn.Module, tokens: mx.array, start: int, step: int) -> float:
    """One prefill as a request's runs: mlx-lm's ``generate_step`` to the
    first token, in chunks of ``step`` (the cache grows and is copied between
    chunks, and mlx's buffer cache is emptied after each: timing the forward
    passes alone predicted 0.7x of what an 8K prompt took the engine on the
    H100), after an untimed prefix of ``start`` tokens."""
    cache = C.make_prompt_cache(m)
    if start:
        m(tokens[None, :start], cache=cache)
        mx.eval([c.state for c in cache])
    steps = generate_step(tokens[start:], m, max_tokens=1, prompt_cache=cache, prefill_step_size=step)
    t = time.perf_counter()
    next(steps)
    seconds = time.perf_counter() - t
    steps.close()
    mx.synchronize()  # (the next token, queued before the first was read, is not the next timing's)
    return seconds


def _predicted_s(done: list[tuple[int, float, float]], stop: int, runs: int) -> float:
    """Wall seconds the timed runs of a ``stop``-token prefill will take, from
    ``done``: ``(tokens, first run's wall seconds, steady run's)`` of those
    timed so far. What the last one's first run took past its steady one is
    set-up (compiling kernels for a new length) and is added once; the
    steady time is scaled by the growth the last two showed, between linear
    and quadratic (attention's share grows with the length)."""
    n1, first, steady = done[-1]
    power = 1.0
    if len(done) > 1 and done[-2][0] < n1 and done[-2][2] > 0:
        n0, _, s0 = done[-2]
        power = min(2.0, max(1.0, math.log(max(steady, 1e-9) / s0) / math.log(n1 / n0)))
    return max(0.0, first - steady) + runs * steady * (stop / n1) ** power


def calibrate(store: PrefixStore, key: str, models: Sequence[nn.Module], *, budget_s: float = 3.0,
              sizes: Sequence[tuple[int, int]] = LADDER, step: int = 2048, runs: int = 2) -> Calibration:
    """Time prefills of random tokens, ``(cached, total)`` each of ``sizes`` in
    order, and report them to the store (``observe_prefill``), while they fit
    ``budget_s``: a prefill is started only where the time it is predicted to
    take fits what is left, so the total exceeds the budget by at most what
    the last one took past its prediction (the first, of a few tokens, is
    always timed). Each is the faster of ``runs`` (a process's first prefill
    of a length compiles kernels: on CUDA 3-10x the next one, which would have
    the store predict every prefill far too slow), where another run fits. Token ids are drawn from the models' vocabulary
    (``vocab_size``)."""
    out = Calibration()
    vocab = vocab_size(models)
    if vocab is None:
        out.skipped = "the model's vocabulary size cannot be read"
        return out
    t0 = time.perf_counter()
    done: list[tuple[int, float, float]] = []  # (tokens, first run's wall seconds, steady run's)
    for start, stop in sizes:
        if done and time.perf_counter() - t0 + _predicted_s(done, stop, runs) > budget_s:
            break
        tokens = random_tokens(vocab, stop)
        best, walls = [math.inf] * len(models), [[] for _ in models]
        for _ in range(runs):
            for i, m in enumerate(models):
                w = time.perf_counter()
                best[i] = min(best[i], _prefill_s(m, tokens, start, step))
                walls[i].append(time.perf_counter() - w)
            if time.perf_counter() - t0 + sum(w[-1] for w in walls) > budget_s:  # (a run is no slower than the first)
                break
        store.observe_prefill(key, start, stop, sum(best))
        out.timed.append((start, stop, sum(best)))
        done.append((stop, sum(w[0] for w in walls), sum(min(w) for w in walls)))
    store.knows_prefill(key)  # the prefill model is fitted here, not in the first request's fetch
    out.seconds = time.perf_counter() - t0
    return out


# stores -> model keys calibrated in this process (a model too slow to time enough prefills is not retried)
_CALIBRATED: "weakref.WeakKeyDictionary[PrefixStore, set[str]]" = weakref.WeakKeyDictionary()


def calibrate_once(store: PrefixStore, key: str, models: Sequence[nn.Module]) -> float:
    """``calibrate`` under the store's ``calibrate_budget_s`` where
    ``fetch_policy="auto"`` will weigh a hit against a prefill it knows
    nothing of (a model whose prefills this store, or an earlier run on this
    machine, never saw), once per model and store in a process; returns the
    seconds it took. The model's shape goes to the store every time
    (``context_ratio``)."""
    if store.fetch_policy != "auto":
        return 0.0
    store.set_context_ratio(key, context_ratio(models))
    done = _CALIBRATED.setdefault(store, set())
    if key in done or store.knows_prefill(key):
        return 0.0
    done.add(key)
    budget = store.config.calibrate_budget_s
    name = key[:12] if isinstance(key, str) else bytes(key).hex()[:12]
    if budget <= 0:
        log.info("kvstore: prefill of model %s not calibrated (calibrate_budget_s=0): fetch_policy='auto' "
                 "serves its hits until requests have timed its prefill", name)
        return 0.0
    log.info("kvstore: timing prefills of model %s for fetch_policy='auto' within a budget of %.1f s, each "
             "started only where its predicted time fits (skip: calibrate_budget_s=0 / --calibrate-budget-s 0, "
             "or fetch_policy='always')", name, budget)
    got = calibrate(store, key, models, budget_s=budget)
    if got.skipped:
        log.info("kvstore: prefill of model %s not calibrated: %s", name, got.skipped)
    else:
        lengths = sorted({stop for _, stop, _ in got.timed})
        more = "" if len(got.timed) >= _MIN_FIT else \
            "; too slow for a fit: its hits are served until requests have timed its prefill"
        over = "" if got.seconds <= budget else f" (past the {budget:g} s budget: the last took longer than predicted)"
        log.info("kvstore: timed %d prefills of model %s (%s tokens) in %.1f s%s%s", len(got.timed), name,
                 "/".join(map(str, lengths)), got.seconds, over, more)
    return got.seconds


_TERMS: dict[int, tuple[int, int]] = {}  # id(model) -> _shape_terms, while the model lives


def context_ratio(models: Sequence[nn.Module]) -> float:
    """Multiply-adds of attention per token of context (scores and weighted
    sum, over full-attention layers: a sliding window's cost stops growing)
    over multiply-adds per token through the weights, for ``models`` run
    together; 0.0 where the model's shape cannot be read."""
    weights = attention = 0
    for m in models:
        if id(m) not in _TERMS:
            _TERMS[id(m)] = _shape_terms(m)
            weakref.finalize(m, _TERMS.pop, id(m), None)
        w, a = _TERMS[id(m)]
        weights, attention = weights + w, attention + a
    return attention / weights if weights and attention else 0.0


def _shape_terms(model: nn.Module) -> tuple[int, int]:
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if not heads:
        return 0, 0
    head_dim = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 0) // heads
    full = sum(1 for c in C.make_prompt_cache(model) if type(c) is C.KVCache)
    weights = 0
    for _, mod in tree_flatten(model.leaf_modules(), is_leaf=lambda x: isinstance(x, nn.Module)):
        if isinstance(mod, nn.QuantizedLinear):
            weights += mod.weight.shape[0] * mod.weight.shape[1] * 32 // mod.bits
        elif isinstance(mod, nn.Linear):
            weights += mod.weight.size
    return weights, full * heads * head_dim * 2
