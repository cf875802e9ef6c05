"""The store's side of the cost model (``cost``): what a fetch's blocks would
cost where they are now, what a served fetch really cost, and keeping the
estimates per machine in the store.

``plan`` reads page-cache residency from disk, so it runs without the store
lock (taking it only to read the path's nodes).
"""

from __future__ import annotations

from typing import Optional

from . import lookup
from .cost import CostModel, Plan, machine_id
from .counters import Counters
from .index import Node
from .persist import Persist
from .tiers.ram import RamTier

_CACHED = 0.9  # a block with this share of its pages in the page cache reads as cached


class FetchCosts:
    def __init__(self, cost: CostModel, ram: RamTier, persist: Optional[Persist], lock, counters: Counters):
        self.cost = cost
        self.ram = ram
        self.persist = persist
        self.lock = lock
        self.counters = counters

    def plan(self, root: bytes, n_prompt: int, path: list[Node], servable: int) -> Plan:
        """How much of the servable prefix to load: per block its tier and, on
        disk, whether its pages are cached."""
        if not path:
            return Plan(servable, servable)
        with self.lock:
            blocks = [self.ram.get(p.key) if p.in_ram else None for p in path]
            sizes = [b.nbytes if b is not None else p.nbytes for p, b in zip(path, blocks)]
            constrained = any(p.snap is not None or p.gap for p in path)
            on_disk = {p.key: (p.offset, p.nbytes) for p, b in zip(path, blocks) if b is None}
        resident: dict = {}
        if on_disk and self.persist is not None:
            try:
                resident = self.persist.disk.resident(on_disk)
            except Exception:
                resident = {}
        states = ["ram" if b is not None else
                  "ssd_cached" if (resident.get(p.key) or 0) >= _CACHED else "ssd_cold"
                  for p, b in zip(path, blocks)]
        limit_to = (lambda n: lookup.servable([p for p in path if p.start < n], n)) if constrained else None
        plan = self.cost.plan(root.hex(), n_prompt, [p.start for p in path], [p.end for p in path], sizes,
                              states, servable, limit_to)
        plan.states = dict(zip((p.key for p in path), states))
        plan.unknown = frozenset(k for k in on_disk if resident.get(k) is None)  # planned as cold
        return plan

    def observe(self, path: list[Node], sizes: list[int], from_ram: list[bool], length: int, plan: Plan,
                seconds: float) -> dict[str, int]:
        """Rates of a served fetch, per source, each charged its share of the
        time by bytes (blocks are read and assembled in one pass). A fetch
        with a disk block of unknown residency teaches nothing: its time
        would be charged to a rate it may not belong to."""
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
            self.counters.count("predicted_us", int(plan.load_s * 1e6))
            self.counters.count("actual_us", int(seconds * 1e6))
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

    def load(self) -> None:
        """Start from what earlier runs on this machine measured."""
        try:
            saved = (self.persist.disk.get_info("rates") or {}).get(machine_id())
        except Exception:
            saved = None
        if saved:
            self.cost.merge_saved(saved)

    def save(self) -> None:
        if self.persist is None or not self.cost.dirty:
            return
        try:
            rates = self.persist.disk.get_info("rates") or {}
            rates[machine_id()] = self.cost.to_dict()
            self.persist.disk.set_info("rates", rates)
        except Exception as e:
            self.persist.failed("saving measured rates to", e)
