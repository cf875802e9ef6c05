"""PrefixStore as a state machine: any sequence of put, fetch, flush, close +
reopen and budget changes keeps the store's promises.

- A hit is a prefix of the prompt, never longer than what was put, and its KV
  is exactly the KV of those tokens (never another prompt's KV).
- RAM never holds more than its budget.
- With an SSD tier (and room on disk) nothing put is ever lost: every fetch
  serves the longest prefix shared with anything put, also after reopening.
- With RAM only and a large budget, the same holds until the budget shrinks.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstore.config import GB
from kvstore.hit import REASONS
from kvstore.store import PrefixStore

from ._helpers import assert_hit_is, kv_layers

BS = 4
MODEL = "tiny-model"
LARGE = 1 << 30
# Roughly: 0, one block, three blocks (a block of 2 layers is ~1 KiB dense).
SMALL_BUDGETS = [0, 1500, 3500]

# A few shared prefixes (some diverging mid-block) so hits and dedup happen.
BASES = [(), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 7, 7, 7, 7), (1, 2, 9), (3, 3, 3, 3, 3, 3, 3, 3)]
prompts = st.builds(lambda base, tail: base + tuple(tail), st.sampled_from(BASES),
                    st.lists(st.integers(0, 3), max_size=7)).filter(len)


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assert_reasons_add_up(hit, p: tuple) -> None:
    """Issue 53: every token not served has a reason; with what was served they are the prompt's tokens."""
    assert all(k in REASONS and v > 0 for k, v in hit.not_served.items()), hit.not_served
    assert hit.length + sum(hit.not_served.values()) == len(p), (hit.length, hit.not_served, len(p))


def blocks_of(p: tuple) -> set[tuple]:
    """A block is named by the prefix it ends (chained keys): full blocks and a tail."""
    return {p[: min(i + BS, len(p))] for i in range(0, len(p), BS)}


@dataclass
class Config:
    ssd: bool
    kv_bits: Optional[int] = None


class StoreMachine(RuleBasedStateMachine):
    config: Config
    tmp: str

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(dir=self.tmp)
        self.budget = LARGE
        self.lossless = True
        self.puts: list[tuple] = []
        self.blocks: set[tuple] = set()
        self.store = self._open()

    def _open(self) -> PrefixStore:
        return PrefixStore(budget_gb=self.budget / GB, block_size=BS, kv_bits=self.config.kv_bits,
                           kv_group_size=32, ssd_path=f"{self.dir}/store" if self.config.ssd else None,
                           disk_budget_gb=1.0)

    def longest_put(self, p: tuple) -> int:
        return max((lcp(q, p) for q in self.puts), default=0)

    @rule(p=prompts)
    def put(self, p):
        new = self.store.put(MODEL, list(p), kv_layers(p))
        want = len(blocks_of(p) - self.blocks)
        if self.lossless:
            assert new == want, f"put stored {new} blocks, {want} were new"
        else:
            assert 0 <= new <= len(blocks_of(p))
        self.puts.append(p)
        self.blocks |= blocks_of(p)

    @rule(p=prompts, cut=st.none() | st.integers(0, 3))
    def fetch(self, p, cut):
        limit = None if cut is None else max(0, len(p) - cut)
        hit = self.store.fetch(MODEL, list(p), limit=limit)
        n = len(p) if limit is None else limit
        assert_reasons_add_up(hit, p)
        assert hit.not_served.get("limit", 0) == len(p) - max(n, hit.length)
        best = self.longest_put(p[:n])
        assert 0 <= hit.length <= best, f"hit of {hit.length} tokens, at most {best} were ever put"
        if self.lossless:
            assert hit.length == best, f"lost data: hit of {hit.length} tokens, {best} were put"
            assert not {"evicted", "skipped", "corrupt", "unavailable"} & set(hit.not_served), hit.not_served
        assert_hit_is(hit, p, hit.length, self.config.kv_bits)

    @precondition(lambda self: self.puts)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=5))
    def fetch_put_prompt(self, data, extra):
        """A prompt put before (possibly continued) is served in full when nothing was lost."""
        p = data.draw(st.sampled_from(self.puts)) + tuple(extra)
        hit = self.store.fetch(MODEL, list(p))
        assert_reasons_add_up(hit, p)
        best = self.longest_put(p)
        assert hit.length <= best
        if self.lossless:
            assert hit.length == best
        assert_hit_is(hit, p, hit.length, self.config.kv_bits)

    @rule()
    def flush(self):
        self.store.flush()
        s = self.store.stats()
        assert s["pending_bytes"] == 0 and s["pending_jobs"] == 0
        assert s["ram_bytes"] <= s["ram_budget"]

    @rule()
    def close_and_reopen(self):
        self.store.close()
        self.store = self._open()
        if not self.config.ssd:  # RAM only: a new process starts empty
            self.puts, self.blocks = [], set()
            self.lossless = self.budget == LARGE
            assert len(self.store) == 0

    @rule(budget=st.sampled_from(SMALL_BUDGETS + [LARGE] * 3))
    def set_budget(self, budget):
        self.store.set_budget(budget / GB)
        self.budget = budget
        if budget != LARGE and not self.config.ssd:
            self.lossless = False
        s = self.store.stats()
        assert s["ram_budget"] == budget
        if s["pending_bytes"] == 0:
            assert s["ram_bytes"] <= budget

    @invariant()
    def ram_within_budget(self):
        """Whenever no write is in flight, RAM holds at most its budget."""
        s = self.store.stats()
        if s["pending_bytes"] == 0:
            self.store.flush()  # (blocks a fetch read from disk are promoted to RAM on a thread of their own)
            s = self.store.stats()
            assert s["ram_bytes"] <= s["ram_budget"], s
            assert self.store.nbytes == s["ram_bytes"]

    @invariant()
    def index_holds_every_block_put(self):
        if self.lossless:
            assert len(self.store) == len(self.blocks)

    def teardown(self):
        self.store.close()
        if self.config.ssd and self.lossless:
            # everything put is still there for the next process, exactly
            with PrefixStore(budget_gb=0.01, block_size=BS, ssd_path=f"{self.dir}/store", readonly=True) as ro:
                for p in self.puts:
                    assert_hit_is(ro.fetch(MODEL, list(p)), p, len(p), self.config.kv_bits)


CONFIGS = {
    "ram-only": Config(ssd=False),
    "ram+ssd": Config(ssd=True),
    "ram+ssd-kv8": Config(ssd=True, kv_bits=8),
    "ram-only-kv8": Config(ssd=False, kv_bits=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_store_state_machine(name, tmp_path):
    """Random put/fetch/flush/reopen/budget sequences never serve wrong KV,
    never exceed the RAM budget, and lose nothing that SSD should keep."""
    machine = type(f"StoreMachine_{name}", (StoreMachine,), {"config": CONFIGS[name], "tmp": str(tmp_path)})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
