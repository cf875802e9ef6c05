"""Full disk: the disk budget evicts least recently used prompts; a full
filesystem (a small tmpfs) keeps ``put`` working in RAM, stops spilling or
evicts under one warning, raises nothing into the caller, and serves exact KV.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvstore import PrefixStore

from . import kvdata as D
from .._helpers import small_tmpfs

MODEL = "disk-model"
MiB = 1 << 20


def _kvstore_records(caplog, level=logging.WARNING) -> list:
    return [r for r in caplog.records if r.name == "kvstore" and r.levelno >= level]


def test_disk_budget_evicts_least_recently_used(tmp_path):
    path = tmp_path / "store"
    budget = 1.5 * MiB
    prompts = [D.tokens(3000 + i, 64) for i in range(60)]
    samples = []
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=D.BLOCK, disk_budget_gb=budget / (1 << 30)) as store:
        for i, toks in enumerate(prompts):
            store.put(MODEL, toks, D.layers_for(toks))
            store.flush()
            hit = store.fetch(MODEL, prompts[0])  # prompt 0 stays in use: LRU keeps it
            assert hit.length == 64 and D.hit_problem(hit, prompts[0]) is None
            store.flush()
            samples.append(store.stats()["ssd_bytes"])
        assert store.stats()["evictions_ssd"] > 0
    assert max(samples) <= budget, f"usage {max(samples)} over the {budget:.0f}-byte budget"
    assert samples[-1] >= 0.5 * budget  # near the budget, not emptied
    assert os.path.getsize(path / "data.mdb") <= 3 * budget + MiB  # freed pages are reused
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK) as store:
        lengths = []
        for toks in prompts:
            hit = store.fetch(MODEL, toks)
            assert D.hit_problem(hit, toks) is None
            lengths.append(hit.length)
    assert lengths[0] == 64, "the prompt in use was evicted"
    assert all(n == 64 for n in lengths[-10:]), lengths  # the newest stay
    assert all(n == 0 for n in lengths[1:11]), lengths  # the oldest unused went first
    rc, out = D.run_verify(path)
    assert rc == 0, out


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (needs root and mount rights; skipped otherwise)."""
    with small_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _fill(mnt: Path) -> None:
    with open(mnt / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\xab" * 65536)
                f.flush()
        except OSError:
            pass


def test_full_filesystem_keeps_working_in_ram(small_fs, caplog):
    path = small_fs / "store"
    caplog.set_level(logging.INFO, logger="kvstore")
    prompts = [D.tokens(4000 + i, 100) for i in range(300)]  # ~25 MiB of blocks for an 8 MiB device
    store = PrefixStore(budget_gb=0.1, ssd_path=path, block_size=D.BLOCK, disk_budget_gb=1)
    try:
        for i, toks in enumerate(prompts):
            store.put(MODEL, toks, D.layers_for(toks))
            if i % 10 == 9:
                store.flush()
                hit = store.fetch(MODEL, prompts[i - 5])
                assert hit.length == 100 and D.hit_problem(hit, prompts[i - 5]) is None
        store.flush()
        toks = D.tokens(4999, 50)  # a model first seen with the device full: registering it fails quietly
        store.put("another-model", toks, D.layers_for(toks))
        store.flush()
        hit = store.fetch("another-model", toks)
        assert hit.length == 50 and D.hit_problem(hit, toks, 0) is None
        for toks in prompts:
            hit = store.fetch(MODEL, toks)
            assert hit.length == 100 and D.hit_problem(hit, toks) is None
        st = store.stats()
        assert st["write_errors"] >= 1, "the device never filled: the test did not test anything"
        assert st["write_errors"] <= 3, f"{st['write_errors']} failed writes: the tier kept spilling into a full device"
    finally:
        store.close()
    warnings = _kvstore_records(caplog)
    assert len(warnings) == 1 and "is full" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    # what made it to disk is whole
    rc, out = D.run_verify(path)
    assert rc == 0, out
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK) as store:
        served = 0
        for toks in prompts:
            hit = store.fetch(MODEL, toks)
            assert D.hit_problem(hit, toks) is None
            served += hit.length == 100
        assert served > 0


def _open_in_child(path: Path) -> str:
    """Open, fetch prompt 5000 (100 tokens), put prompt 5001, close."""
    return D.open_in_child(path, MODEL, 5000, 100, budget_gb=0.1, put_prompt_id=5001)


def test_opening_on_a_full_filesystem(small_fs):
    """A new store on a full device is a clear error (LMDB would SIGBUS on
    its sparse lock file); an existing one opens, serves, and takes puts."""
    old = small_fs / "old"
    with PrefixStore(ssd_path=old, block_size=D.BLOCK, disk_budget_gb=1) as store:
        toks = D.tokens(5000, 100)
        store.put(MODEL, toks, D.layers_for(toks))
    _fill(small_fs)
    out = _open_in_child(small_fs / "new")
    assert out.startswith("StoreOpenError:") and str(small_fs / "new") in out and "space" in out, out
    out = _open_in_child(old)
    assert "opened; hit 100 None" in out and "closed" in out, out
