"""Cost-aware fetch: serve the stored prefix only where loading it beats
recomputing it.

The physics differ by machine: an 8B model on an H100 prefills faster than a
cold SSD reads fp16 KV, Apple silicon prefills 10-100x slower than it loads,
and a page-cached file flips the answer again. So nothing here is assumed for
long: the store measures what its fetches cost per tier and state (bytes/s to
ready arrays: ``ram``, ``ssd_cached``, ``ssd_cold``), the adapter reports
what the engine's prefills cost, and each fetch picks the prefix length that
minimizes load + prefill of the rest.

Prefill of tokens ``[s, e)`` after a cached prefix of ``s`` is modelled as
``a + b (e - s) + c (e^2 - s^2) / 2``: a fixed part, a per-token part, and
attention whose cost grows with the context (each new token attends to all
before it). The three are fitted by least squares to recent observations.
The context term barely shows in prefills of a few hundred tokens (2% of an
8B model's 1K prefill, a quarter of its 32K one), so where the adapter tells
the model's shape (``context_ratio``: attention FLOPs per token of context
over weight FLOPs per token) ``c`` is tied to ``b`` by it and only ``a`` and
``b`` are fitted: short calibration prefills then predict long ones.
A hit is served only where it is predicted to save ``margin`` of
recomputing: the rates and the model are estimates, and a hit has costs they
do not model (a process's first hit of a kind sets up buffers and kernels:
docs/benchmarks.md, cost). Declining a near tie costs at most that share.
Until a tier's rate is measured, a prior stands in for it (``probe``: timed
once per machine, erring toward declining); the adapters time a few prefills
of a model before its first fetch (``calibrate``). A measurement replaces a
prior, and the plan is the same for both. Without a prefill model, or a rate
or prior for a tier, fetches serve everything (and so measure it).

Estimates are kept per machine in the store's LMDB meta, so a restart starts
from what was learned.
"""

from __future__ import annotations

import math
import platform
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..config import check_policy

STATES = ("ram", "ssd_cached", "ssd_cold")
# what a fetch costs before any byte moves (walk, assemble set-up), seconds; measured values replace it
_FIXED_LOAD_S = 0.5e-3
_MIN_OBS = 3  # prefill observations before the model is trusted
_KEEP_OBS = 64
_EWMA = 0.3


def machine_id() -> str:
    """What the measured rates belong to: this host and its default device."""
    import mlx.core as mx
    return f"{platform.node()}|{platform.machine()}|{mx.default_device()}"


@dataclass
class PrefillModel:
    """Seconds to prefill ``[start, stop)`` after a cached prefix of ``start``."""

    a: float
    b: float
    c: float

    def seconds(self, start: int, stop: int) -> float:
        return float(self.seconds_from(np.array([start], dtype=np.float64), stop)[0])

    def seconds_from(self, starts: np.ndarray, stop: int) -> np.ndarray:
        """``seconds(start, stop)`` for each of ``starts`` (float64)."""
        t = self.a + self.b * (stop - starts) + self.c * (float(stop) * stop - starts * starts) / 2
        return np.where(starts < stop, t, 0.0)

    @classmethod
    def fit(cls, obs: Sequence[tuple[int, int, float]], ratio: Optional[float] = None) -> "PrefillModel":
        """Least squares over ``(start, stop, seconds)``, every coefficient >= 0
        (with ``ratio``, ``c = ratio * b``). Observations over twice what that
        fit predicts are dropped and the rest refit: a process's first request
        at a new length compiles kernels (one such request, 10x slow, doubled
        an 8B model's predicted 32K prefill on the H100 and made loading a cold
        SSD look faster than recomputing)."""
        m = cls._fit(obs, ratio)
        keep = [o for o in obs if o[2] <= 2 * m.seconds(o[0], o[1])]
        return cls._fit(keep, ratio) if _MIN_OBS <= len(keep) < len(obs) else m

    @classmethod
    def _fit(cls, obs: Sequence[tuple[int, int, float]], ratio: Optional[float]) -> "PrefillModel":
        quad = np.array([(e * e - s * s) / 2 for s, e, _ in obs])
        lin = np.array([e - s for s, e, _ in obs], dtype=float)
        X = np.stack([np.ones(len(obs)), lin, quad], axis=1) if ratio is None \
            else np.stack([np.ones(len(obs)), lin + ratio * quad], axis=1)
        y = np.array([t for _, _, t in obs])
        cols = list(range(X.shape[1]))
        while True:  # drop coefficients that come out negative and refit (a tiny NNLS)
            coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if (coef >= 0).all() or len(cols) == 1:
                break
            cols = [c for c, v in zip(cols, coef) if v >= 0] or [1]
        full = [0.0] * X.shape[1]
        for c, v in zip(cols, coef):
            full[c] = max(0.0, float(v))
        return cls(*full) if ratio is None else cls(full[0], full[1], ratio * full[1])


@dataclass
class Plan:
    """What a fetch will serve and why."""

    length: int  # tokens to load
    servable: int  # tokens the store could have served
    load_s: float = 0.0  # predicted seconds to load ``length``
    prefill_s: float = 0.0  # predicted seconds to prefill the rest
    reason: str = ""
    states: dict = field(default_factory=dict)  # block key -> where it loads from (``STATES``)
    unknown: frozenset = frozenset()  # disk blocks whose page-cache residency could not be told

    @property
    def cold(self) -> frozenset:
        """Keys of disk blocks known to be out of the page cache."""
        return frozenset(k for k, s in self.states.items() if s == "ssd_cold") - self.unknown

    @property
    def skipped(self) -> int:
        return self.servable - self.length


@dataclass
class _Rate:
    bytes_per_s: float
    observed: int = 0  # 0: a prior (``probe``), replaced by the first measurement
    end_to_end: bool = False  # measured to the engine's first token (what the engine really paid)


@dataclass
class CostModel:
    """Rates of this machine and the fetch policy. Thread-safe."""

    policy: str = "auto"
    rates: dict[str, _Rate] = field(default_factory=dict)
    prefill_obs: dict[str, deque] = field(default_factory=dict)
    fixed_s: float = _FIXED_LOAD_S
    margin: float = 0.05  # ``StoreConfig.serve_margin``
    dirty: bool = False  # observed since last saved
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _models: dict[str, PrefillModel] = field(default_factory=dict, repr=False)
    _ratios: dict[str, float] = field(default_factory=dict, repr=False)  # model -> context_ratio (not kept)

    def __post_init__(self):
        self.set_policy(self.policy)

    def set_policy(self, policy: str) -> None:
        check_policy(policy)
        self.policy = policy

    # ------------------------------------------------------------ observing

    def observe_load(self, state: str, nbytes: int, seconds: float, end_to_end: bool = False) -> None:
        """A load of ``nbytes`` from ``state`` took ``seconds``. The store times
        its fetch to arrays; an adapter that times the whole hit (to the
        first token) reports ``end_to_end``: on a GPU, arrays still move to
        the device inside the first forward pass, so from then on only such
        observations count for that source."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            self.dirty = True
            r = self.rates.get(state)
            if r is not None and r.end_to_end and not end_to_end:
                return
            if r is None or r.observed == 0 or (end_to_end and not r.end_to_end):
                self.rates[state] = _Rate(rate, 1, end_to_end)
            else:
                r.bytes_per_s = (1 - _EWMA) * r.bytes_per_s + _EWMA * rate
                r.observed += 1

    def observe_prefill(self, model: str, start: int, stop: int, seconds: float) -> None:
        if stop <= start or seconds <= 0 or not math.isfinite(seconds):
            return
        with self._lock:
            obs = self.prefill_obs.setdefault(model, deque(maxlen=_KEEP_OBS))
            obs.append((int(start), int(stop), float(seconds)))
            self._models.pop(model, None)
            self.dirty = True

    def set_context_ratio(self, model: str, ratio: float) -> None:
        """The model's attention FLOPs per token of context over its weight
        FLOPs per token: ties the prefill model's context term to its
        per-token one (``PrefillModel.fit``)."""
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        with self._lock:
            if self._ratios.get(model) != ratio:
                self._ratios[model] = float(ratio)
                self._models.pop(model, None)

    def assume(self, state: str, bytes_per_s: float) -> None:
        """A prior for ``state`` until its rate is measured."""
        with self._lock:
            if state not in self.rates and bytes_per_s > 0:
                self.rates[state] = _Rate(float(bytes_per_s))
                self.dirty = True

    def unknown(self, states) -> set[str]:
        """Those of ``states`` with neither a measured rate nor a prior."""
        with self._lock:
            return {s for s in states if s not in self.rates}

    def prefill_model(self, model: str) -> Optional[PrefillModel]:
        with self._lock:
            return self._prefill_model(model)

    def _prefill_model(self, model: str) -> Optional[PrefillModel]:
        obs = self.prefill_obs.get(model)
        if not obs or len(obs) < _MIN_OBS:
            return None
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = PrefillModel.fit(list(obs), self._ratios.get(model))
        return m

    # ------------------------------------------------------------- deciding

    def plan(self, model: str, n_prompt: int, starts: Sequence[int], ends: Sequence[int], nbytes: Sequence[int],
             states: Sequence[str], servable: int, limit_to: Optional[Callable[[int], int]] = None) -> Plan:
        """The prefix length to load. ``starts``/``ends``/``nbytes``/``states``:
        each block on the path, in order; ``servable``: the longest length the
        store can serve; ``limit_to(L)``: the longest servable length <= L,
        where not every length is (state snapshots, sliding windows)."""
        decided = self._by_policy(servable)
        if decided is not None:
            return decided
        pm, rates, priors = self._inputs(model, states)
        unknown = {s for s in states if s not in rates}
        if pm is None or unknown:
            why = "prefill rate not measured yet" if pm is None else f"no rate for {', '.join(sorted(unknown))} yet"
            return Plan(servable, servable, reason=f"serving all: {why}")
        secs = np.array([b / rates[s] for b, s in zip(nbytes, states)])  # each whole block
        n = _cuts(ends, servable, limit_to)
        load = _load_seconds(n, starts, ends, secs, self.fixed_s)
        prefill = pm.seconds_from(n, n_prompt)
        k = int(np.argmin(load + prefill))  # (the first of equals: the longer prefix)
        best = Plan(int(n[k]), servable, float(load[k]), float(prefill[k]))
        none = Plan(int(n[-1]), servable, float(load[-1]), float(prefill[-1]))  # recompute it all
        return self._weighed(best, none, servable, priors)

    def _by_policy(self, servable: int) -> Optional[Plan]:
        """The plan the policy decides with no rates (``always``, ``never``, nothing servable), else None."""
        if self.policy == "always" or servable == 0:
            return Plan(servable, servable, reason="policy always" if servable else "")
        if self.policy == "never":
            return Plan(0, servable, reason="policy never")
        return None

    def _inputs(self, model: str, states: Sequence[str]
                ) -> tuple[Optional[PrefillModel], dict[str, float], list[str]]:
        """The model's prefill, every known rate, and those of ``states`` that are priors only (one look under
        the lock)."""
        with self._lock:
            rates = {s: r.bytes_per_s for s, r in self.rates.items()}
            priors = sorted({s for s in states if s in rates and not self.rates[s].observed})
            return self._prefill_model(model), rates, priors

    def _weighed(self, best: Plan, none: Plan, servable: int, priors: list[str]) -> Plan:
        """``best`` unless its saving over recomputing it all (``none``) is under the margin; with its reason."""
        saving = none.prefill_s - (best.load_s + best.prefill_s)
        if best.length and saving < self.margin * none.prefill_s:
            best = none
            best.reason = (f"a predicted saving of {saving * 1e3:.1f} ms, under {self.margin:.0%} of recomputing, "
                           f"is not worth a hit")
        elif best.length < servable:
            best.reason = ("recomputing is faster than loading" if best.length == 0 else
                           f"loading past token {best.length} is slower than recomputing")
        if best.length < servable and priors:
            best.reason += f" (rates assumed, not measured yet: {', '.join(priors)})"
        return best

    # --------------------------------------------------------------- saving

    def describe(self, model: Optional[str] = None) -> dict:
        """Rates and prefill models, for ``stats()``."""
        with self._lock:
            rates = {s: {"gb_per_s": r.bytes_per_s / 1e9, "observed": r.observed, "prior": not r.observed}
                     for s, r in self.rates.items()}
            keys = list(self.prefill_obs)
        models = {}
        for k in keys if model is None else [model]:
            pm = self.prefill_model(k)
            n = len(self.prefill_obs.get(k, ()))
            models[k] = {"observed": n, **({} if pm is None else
                                           {"a_s": pm.a, "s_per_token": pm.b, "s_per_token_context": pm.c,
                                            "tokens_per_s_at_8k": 8192 / pm.seconds(0, 8192)
                                            if pm.seconds(0, 8192) > 0 else None})}
        return {"policy": self.policy, "rates": rates, "prefill": models}

    def to_dict(self) -> dict:
        with self._lock:
            self.dirty = False
            return {"rates": {s: [r.bytes_per_s, r.observed, r.end_to_end] for s, r in self.rates.items()},
                    "prefill": {k: [list(o) for o in v] for k, v in self.prefill_obs.items()}}

    def merge_saved(self, saved: dict) -> None:
        """Start from estimates a previous run of this machine saved."""
        try:
            with self._lock:
                for s, (rate, n, *e2e) in saved.get("rates", {}).items():
                    if s in STATES and s not in self.rates and rate > 0:
                        self.rates[s] = _Rate(float(rate), int(n), bool(e2e and e2e[0]))
                for k, obs in saved.get("prefill", {}).items():
                    if k not in self.prefill_obs:
                        self.prefill_obs[k] = deque(((int(a), int(b), float(t)) for a, b, t in obs),
                                                    maxlen=_KEEP_OBS)
        except (TypeError, ValueError, AttributeError):
            pass  # a damaged record of estimates: start from the defaults


def _cuts(ends: Sequence[int], servable: int, limit_to: Optional[Callable[[int], int]]) -> np.ndarray:
    """The lengths a plan weighs, longest first: 0, ``servable`` and each block's end (each made servable)."""
    cuts = {0, servable} | {min(int(e), servable) for e in ends}
    if limit_to is not None:
        cuts = {limit_to(c) if c else 0 for c in cuts}
    return np.array(sorted(cuts, reverse=True), dtype=np.float64)


def _load_seconds(n: np.ndarray, starts: Sequence[int], ends: Sequence[int], secs: np.ndarray,
                  fixed_s: float) -> np.ndarray:
    """Predicted seconds to load each length of ``n``: the whole blocks before it and its share of the last.
    Every cut at once: a 32K prompt has 129, and a Python loop over them was most of a plan's time."""
    starts_a, ends_a = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    done = np.concatenate([[0.0], np.cumsum(secs)])
    i = np.minimum(np.searchsorted(ends_a, n, side="left"), len(secs) - 1)  # block holding token n-1
    part = np.minimum(1.0, (n - starts_a[i]) / np.maximum(1.0, ends_a[i] - starts_a[i]))
    return np.where(n > 0, fixed_s + done[i] + secs[i] * part, 0.0)
