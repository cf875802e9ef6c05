"""Concurrency: threads of one process, and processes sharing one store.

8 threads put and fetch overlapping prefixes: no exception, the RAM budget
holds at every sampled moment, every hit is exact. Three processes on one
``ssd_path`` see each other's blocks once flushed, without lock-ups or
corruption. A reader that meets a bad block while another thread waits to
resize the LMDB map does not deadlock.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore import PrefixStore

from . import kvdata as D

HERE = Path(__file__).resolve().parent
MODEL = "threads-model"


def _pool(n_families: int = 6, per_family: int = 8) -> list:
    prompts = []
    for f in range(n_families):
        prefix = D.shared_prefix(200 + f, 40)
        for j in range(per_family):
            n = 20 + (j * 37 + f * 11) % 90
            prompts.append(D.tokens(20_000 + f * 100 + j, n, prefix))
    return prompts


def hammer(store: PrefixStore, seconds: float, threads: int = 8, seed: int = 0) -> dict:
    """Threads put / fetch random prompts of a pool with shared prefixes while
    a sampler watches the RAM tier. Returns counts; raises on any problem."""
    prompts = _pool()
    budget = store.stats()["ram_budget"]
    stop = threading.Event()
    errors: list = []
    counts = {"puts": 0, "fetches": 0, "hits": 0, "tokens": 0, "samples": 0, "max_ram": 0}
    lock = threading.Lock()

    def worker(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        puts = fetches = hits = tokens = 0
        try:
            while not stop.is_set():
                toks = rng.choice(prompts)
                if rng.random() < 0.35:
                    store.put(MODEL, toks, D.layers_for(toks))
                    puts += 1
                else:
                    limit = rng.randrange(1, len(toks) + 1) if rng.random() < 0.2 else None
                    hit = store.fetch(MODEL, toks, limit=limit)
                    fetches += 1
                    why = D.hit_problem(hit, toks)
                    if why or (limit is not None and hit.length > limit):
                        errors.append(f"thread {i}: {why or f'hit {hit.length} over limit {limit}'}")
                        stop.set()
                    hits += hit.length > 0
                    tokens += hit.length
        except BaseException as e:  # noqa: BLE001 - any exception is a failure
            errors.append(f"thread {i}: {type(e).__name__}: {e}")
            stop.set()
        with lock:
            counts["puts"] += puts
            counts["fetches"] += fetches
            counts["hits"] += hits
            counts["tokens"] += tokens

    def sampler() -> None:
        while not stop.is_set():
            a = store.nbytes
            b = store.stats()["ram_bytes"]
            counts["samples"] += 1
            counts["max_ram"] = max(counts["max_ram"], a, b)
            if max(a, b) > budget:
                errors.append(f"RAM tier holds {max(a, b)} bytes, budget {budget}")
                stop.set()

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)] + [threading.Thread(target=sampler)]
    start = time.monotonic()
    for t in ts:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in ts:
        t.join(timeout=60)
        assert not t.is_alive(), "a thread is stuck (lock-up)"
    counts["seconds"] = time.monotonic() - start
    assert not errors, errors[:5]
    store.flush()
    # after the storm, every prompt still fetches exactly
    for toks in prompts:
        hit = store.fetch(MODEL, toks)
        assert D.hit_problem(hit, toks) is None
    return counts


def _report(figures, label: str, c: dict) -> None:
    ops = c["puts"] + c["fetches"]
    figures(f"{label}: {ops} ops in {c['seconds']:.1f}s ({ops / c['seconds']:.0f} ops/s: {c['puts']} puts, "
            f"{c['fetches']} fetches, {c['hits']} hits, 0 wrong), RAM max {c['max_ram']} over "
            f"{c['samples']} samples")


RAM_BUDGET_GB = 40 * D.BLOCK * D.KV_ROW_BYTES / (1 << 30)  # about 40 blocks: evictions all the time


@pytest.mark.parametrize("tiers", ["ram", "ram+ssd"])
def test_threads_put_and_fetch_overlapping_prefixes(tmp_path, figures, tiers):
    ssd = tmp_path / "store" if tiers == "ram+ssd" else None
    with PrefixStore(budget_gb=RAM_BUDGET_GB, ssd_path=ssd, block_size=D.BLOCK) as store:
        c = hammer(store, seconds=3.0, seed=1)
        assert store.stats()["evictions_ram"] > 0
    _report(figures, tiers, c)
    assert c["hits"] > 100 and c["puts"] > 50
    if ssd is not None:
        rc, out = D.run_verify(ssd)
        assert rc == 0, out


@pytest.mark.soak
@pytest.mark.parametrize("tiers", ["ram", "ram+ssd"])
def test_threads_soak(tmp_path, figures, tiers):
    ssd = tmp_path / "store" if tiers == "ram+ssd" else None
    with PrefixStore(budget_gb=RAM_BUDGET_GB, ssd_path=ssd, block_size=D.BLOCK) as store:
        c = hammer(store, seconds=60.0, seed=2)
    _report(figures, tiers, c)
    if ssd is not None:
        rc, out = D.run_verify(ssd)
        assert rc == 0, out


def run_sharers(tmp_path: Path, n: int, rounds: int, timeout: float) -> int:
    path, sync = tmp_path / "store", tmp_path / "sync"
    sync.mkdir()
    outs = D.run_workers("child_sharer.py", lambda w: (path, sync, w, n, rounds), n, timeout)
    rc, text = D.run_verify(path)
    assert rc == 0 and ", 0 bad" in text, text
    sys.path.insert(0, str(HERE))
    try:
        import child_sharer
    finally:
        sys.path.remove(str(HERE))
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK) as store:
        for r in range(rounds):
            for w in range(n):
                for toks in child_sharer.round_prompts(w, r):
                    hit = store.fetch(child_sharer.MODEL, toks)
                    assert hit.length == len(toks) and D.hit_problem(hit, toks) is None
    return sum(int(o.split()[-1]) for o in outs)


def test_three_processes_share_one_store(tmp_path, figures):
    fetches = run_sharers(tmp_path, n=3, rounds=6, timeout=120)
    figures(f"3 processes, 6 rounds: {fetches} cross-process fetches, all whole and exact")


@pytest.mark.soak
def test_processes_share_one_store_soak(tmp_path, figures):
    fetches = run_sharers(tmp_path, n=3, rounds=150, timeout=590)
    figures(f"3 processes, 150 rounds: {fetches} cross-process fetches, all whole and exact")


def test_bad_block_while_the_map_is_being_resized_does_not_deadlock(tmp_path, caplog):
    """A reader meets a bad block while another thread waits to adopt a map
    size another process set (which needs every transaction of this process
    closed). Dropping the bad block must not wait for that thread from inside
    the read transaction it is waiting on."""
    path = tmp_path / "store"
    toks = D.tokens(31, 80)
    with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
        store.put(MODEL, toks, D.layers_for(toks))
    key = D.block_key(MODEL, toks, 32)
    D.rewrite(path, key, lambda v: v[:-1] + bytes([v[-1] ^ 1]))
    store = PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK)
    disk = store._disk._tier
    real_stored = disk.stored
    resizers: list[threading.Thread] = []

    def stored(txn, k, *a, **kw):
        if k == key and not (resizers and resizers[-1].is_alive()):
            # every read of the bad block meets a resize another thread is waiting to make, as on
            # MapResizedError there
            resizers.append(threading.Thread(target=disk._adopt_map_size, daemon=True))
            resizers[-1].start()
            while not disk._gate._excl:
                time.sleep(0.001)
        return real_stored(txn, k, *a, **kw)

    disk.stored = stored
    result = {}
    fetcher = threading.Thread(target=lambda: result.update(hit=store.fetch(MODEL, toks)), daemon=True)
    fetcher.start()
    fetcher.join(timeout=20)
    if fetcher.is_alive():
        import kvstore.store
        kvstore.store._OPEN.discard(store)  # its lock is held forever: closing it at exit would hang too
        pytest.fail("fetch deadlocked between the bad block's removal and the map resize")
    for r in resizers:
        r.join(timeout=20)
    assert len(resizers) >= 1
    assert result["hit"].length == 32 and D.hit_problem(result["hit"], toks) is None
    store.close()
