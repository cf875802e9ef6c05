"""The store's side of the cost model (``cost``): what a fetch's blocks would
cost where they are now, what a served fetch really cost, and keeping the
estimates per machine in the store.

``plan`` asks the table where the path's blocks are, then the disk which of
their pages are cached (no I/O: ``mincore``). Until a state's rate is
measured, a prior stands in (``probe``), timed at open under
``fetch_policy="auto"`` (else at the first plan that needs it) and kept with
the measured rates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from . import probe
from ..config import StoreConfig
from .model import STATES, CostModel, Plan, machine_id
from ..state.index import BlockRef
from ..state.lookup import servable as servable_length
from ..gpu.backend import Backend
from ..state.plans import Pinned

if TYPE_CHECKING:
    from ..flow.disk import Disk


class Planner:
    def __init__(self, cost: CostModel, disk: Optional["Disk"], cfg: StoreConfig, backend: Optional[Backend] = None):
        self.cost = cost
        self.disk = disk
        self.cfg = cfg
        self.backend = backend
        self.cached_share = cfg.tuning.cached_share  # a disk block with this share of its pages cached reads as cached

    def plan(self, root: bytes, n_prompt: int, pinned: Pinned, found: Mapping = {},
             in_hand: frozenset = frozenset()) -> Plan:
        """How much of the pinned, servable prefix to load: per block its tier
        and, on disk, whether its pages are cached (``found``: blocks in hand,
        read from the remote, that load as RAM does; ``in_hand``: keys of blocks
        whose rows the fetch holds already, a queued put's, that cost nothing
        more to serve)."""
        path, servable = pinned.path, pinned.length
        if not path:
            return Plan(servable, servable)
        on_disk = {k: v for k, v in pinned.on_disk.items() if k not in in_hand}
        resident = self._resident(on_disk)
        states = [self._state(p.key, b is not None or p.key in found or p.key in in_hand, resident)
                  for p, b in zip(path, pinned.items)]
        sizes = [0 if p.key in in_hand else n for p, n in zip(path, pinned.sizes)]
        if self.cost.policy == "auto":
            self.assume(states)
        limit_to = (lambda n: servable_length([p for p in path if p.start < n], n)) if pinned.constrained else None
        plan = self.cost.plan(root.hex(), n_prompt, [p.start for p in path], [p.end for p in path], sizes,
                              states, servable, limit_to)
        plan.states = dict(zip((p.key for p in path), states))
        plan.unknown = frozenset(k for k in on_disk if resident.get(k) is None)  # planned as cold
        return plan

    def _state(self, key: bytes, in_memory: bool, resident: Mapping[bytes, Optional[float]]) -> str:
        """Where a block loads from: memory, else the page cache when enough of its pages are there, else disk."""
        if in_memory:
            return "ram"
        return "ssd_cached" if (resident.get(key) or 0) >= self.cached_share else "ssd_cold"

    def _resident(self, on_disk: Mapping[bytes, tuple[int, int]]) -> dict:
        """Of each disk block, the share of its pages in the page cache (``None``: unknown)."""
        if not on_disk or self.disk is None:
            return {}
        try:
            return self.disk.resident(on_disk)
        except Exception:
            return {}

    def observe(self, path: list[BlockRef], sizes: list[int], from_ram: list[bool], length: int, plan: Plan,
                seconds: float, counts: dict[str, int]) -> dict[str, int]:
        """Rates of a served fetch, per source, each charged its share of the
        time by bytes (blocks are read and assembled in one pass); its
        predicted and measured times go to ``counts``. A fetch with a disk
        block of unknown residency teaches nothing: its time would be charged
        to a rate it may not belong to."""
        by_state: dict[str, int] = {}
        for p, nbytes, r in zip(path, sizes, from_ram):
            if p.start >= length:
                continue
            if not r and p.key in plan.unknown:
                return {}
            state = "ram" if r else plan.states.get(p.key, "ssd_cold")
            by_state[state] = by_state.get(state, 0) + nbytes * (min(p.end, length) - p.start) // max(1, p.length)
        total = sum(by_state.values())
        for state, nbytes in by_state.items():
            self.cost.observe_load(state, nbytes, seconds * nbytes / max(1, total))
        if plan.load_s:
            counts["predicted_us"] = int(plan.load_s * 1e6)
            counts["actual_us"] = int(seconds * 1e6)
        return by_state

    def observe_request(self, model: str, n_prompt: int, cached: int, source_bytes: dict[str, int],
                        seconds: float) -> None:
        """An engine's request from fetch to first token: all prefill when
        nothing was served; else what the prefill model does not explain was
        the load (host to device moves included)."""
        if cached == 0:
            self.cost.observe_prefill(model, 0, n_prompt, seconds)
            return
        pm = self.cost.prefill_model(model)
        total = sum(source_bytes.values())
        load_s = seconds - (pm.seconds(cached, n_prompt) if pm is not None else 0.0)
        if pm is None or load_s <= 0 or not total:
            return
        for state, nbytes in source_bytes.items():
            self.cost.observe_load(state, nbytes, load_s * nbytes / total, end_to_end=True)

    def assume(self, states) -> None:
        """Priors for those of ``states`` with neither a rate nor a prior: the
        configured ones, else probed (``probe``; tens of ms, once)."""
        if all(s in self.cost.rates for s in states):  # (dict reads: rates are only ever added)
            return
        unknown = self.cost.unknown(states)
        if not unknown:
            return
        try:
            self._assume(unknown)
        except Exception:  # no prior: served, and measured (the behaviour before priors)
            return

    def _assume(self, unknown: set[str]) -> None:
        cfg, gb = self.cfg, 1e9
        arrays = (cfg.tuning.prior_ram_gbps or 0) * gb or probe.array_rate(cfg.tuning.probe_bytes, self.backend)
        for state in unknown:
            if state == "ram":
                rate = arrays
            elif state == "ssd_cached":
                rate = (cfg.tuning.prior_ssd_cached_gbps or 0) * gb or probe.in_series(probe.copy_rate(cfg.tuning.probe_bytes),
                                                                               arrays)
            elif cfg.tuning.prior_ssd_cold_gbps:
                rate = cfg.tuning.prior_ssd_cold_gbps * gb
            else:
                read = probe.direct_read_rate(self.disk.data_file, 4 * cfg.tuning.probe_bytes) \
                    if self.disk is not None else None
                rate = cfg.tuning.prior_cold_share * (probe.in_series(read, arrays) if read else cfg.tuning.unprobed_cold_gbps * gb)
            self.cost.assume(state, rate)

    def start(self) -> None:
        """At open: what earlier runs on this machine measured, then priors for
        the states still unknown where ``fetch_policy="auto"`` will need them."""
        try:
            saved = (self.disk.info("rates") or {}).get(machine_id()) \
                if self.disk is not None and self.cfg.remember_rates else None
        except Exception:
            saved = None
        if saved:
            self.cost.merge_saved(saved)
        if self.cost.policy == "auto":
            self.assume(STATES if self.disk is not None else ("ram",))

    def save_rates(self) -> None:
        if self.disk is None or not self.cost.dirty or not self.cfg.remember_rates:
            return
        try:
            rates = self.disk.info("rates") or {}
            rates[machine_id()] = self.cost.to_dict()
            self.disk.set_info("rates", rates)
        except Exception as e:
            self.disk.failed("saving measured rates to", e)
