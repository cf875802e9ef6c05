"""Crash safety: a writer process SIGKILLed at random moments (often inside a
flush, i.e. an LMDB commit) leaves a store that opens, serves only exact KV,
passes ``kvstore verify``, and still holds every prompt flushed before the kill.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore import PrefixStore

from . import kvdata as D

HERE = Path(__file__).resolve().parent
WRITER = str(HERE / "child_writer.py")
MODEL = "crash-model"


def _start_writer(path: Path, log: Path, seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WRITER, str(path), str(log), str(seed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "ready" in log.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early ({proc.returncode}): {proc.stderr.read().decode()[-3000:]}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("writer did not open the store in time (lock-up?)")


def _read_log(log: Path) -> tuple[int, bool, list[str]]:
    """(last prompt index flushed or -1, killed inside a flush, WRONG lines)."""
    flushed, in_flush, wrong = -1, False, []
    for line in log.read_text().splitlines():
        if line.startswith("D "):
            flushed, in_flush = int(line.split()[1]), False
        elif line.startswith("F "):
            in_flush = True
        elif line.startswith("WRONG"):
            wrong.append(line)
    return flushed, in_flush, wrong


def _check_store(path: Path, must_have: list, may_have: list) -> int:
    """Open the store, fetch prompts: ``must_have`` fully and exactly, any hit
    of ``may_have`` exactly. Returns the number of fetches."""
    store = PrefixStore(budget_gb=0.01, ssd_path=path, block_size=D.BLOCK)
    try:
        for toks in must_have:
            hit = store.fetch(MODEL, toks)
            assert D.hit_problem(hit, toks) is None, D.hit_problem(hit, toks)
            assert hit.length == len(toks), f"flushed prompt lost after kill: hit {hit.length} of {len(toks)}"
        for toks in may_have:
            hit = store.fetch(MODEL, toks)
            assert D.hit_problem(hit, toks) is None, D.hit_problem(hit, toks)
        assert store.stats()["corrupt_blocks"] == 0
    finally:
        store.close()
    return len(must_have) + len(may_have)


def crash_trials(tmp_path: Path, trials: int, seed: int, max_delay: float = 0.5, verify_every: int = 3) -> dict:
    """``trials`` times: start a writer on one shared store, SIGKILL it after a
    random delay, then open the store and check it (the next writer opens the
    store the killed one left, too). ``kvstore verify`` runs every
    ``verify_every`` trials and after the last."""
    rng = random.Random(seed)
    path = tmp_path / "store"
    flushed_all: list[tuple[int, int]] = []  # (writer seed, prompt index)
    in_flush = kills = fetches = 0
    for t in range(trials):
        wseed = seed * 1000 + t
        log = tmp_path / f"writer-{t}.log"
        proc = _start_writer(path, log, wseed)
        try:
            _wait_ready(proc, log)
            time.sleep(rng.uniform(0.0, max_delay))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, f"writer ended by itself ({proc.returncode}): " \
                                                   f"{proc.stderr.read().decode()[-3000:]}"
        proc.stderr.close()
        kills += 1
        last, killed_in_flush, wrong = _read_log(log)
        assert not wrong, wrong
        in_flush += killed_in_flush
        mine = [(wseed, i) for i in range(last + 1)]
        earlier = rng.sample(flushed_all, min(20, len(flushed_all)))
        flushed_all += mine
        # prompts put after the last flush may or may not be there, in part or whole
        maybe = [D.writer_prompt(wseed, i) for i in range(last + 1, last + 40)]
        fetches += _check_store(path, [D.writer_prompt(s, i) for s, i in mine + earlier], maybe)
        if t % verify_every == verify_every - 1 or t == trials - 1:
            rc, out = D.run_verify(path)
            assert rc == 0 and ", 0 bad" in out, f"verify after kill {t}: exit {rc}\n{out}"
    # every prompt flushed by any writer is still there at the end
    fetches += _check_store(path, [D.writer_prompt(s, i) for s, i in flushed_all], [])
    return dict(trials=trials, kills=kills, in_flush=in_flush, flushed=len(flushed_all), fetches=fetches)


def test_sigkill_at_random_moments(tmp_path, figures):
    r = crash_trials(tmp_path, trials=24, seed=1)
    figures(f"{r['kills']} SIGKILLs survived ({r['in_flush']} inside a flush), {r['flushed']} flushed prompts "
            f"all intact, {r['fetches']} exact fetches")
    assert r["kills"] == 24
    assert r["flushed"] > 0
    assert r["in_flush"] >= 1, "no kill landed inside a flush: the test did not exercise commits"


@pytest.mark.soak
def test_sigkill_soak(tmp_path, figures):
    r = crash_trials(tmp_path, trials=200, seed=2, max_delay=1.5)
    figures(f"{r['kills']} SIGKILLs survived ({r['in_flush']} inside a flush), {r['flushed']} flushed prompts "
            f"all intact, {r['fetches']} exact fetches")
    assert r["in_flush"] >= 10


PUT_FETCH = str(HERE / "child_put_fetch.py")
HOLD_LOCK = str(HERE / "child_hold_lock.py")


def test_writer_killed_holding_the_lmdb_write_lock(tmp_path):
    """A process killed inside a write transaction leaves LMDB's writer lock
    to the next writer (robust mutex): no lock-up, the torn transaction is
    gone, and the store stays whole."""
    path = tmp_path / "store"
    first = subprocess.run([sys.executable, PUT_FETCH, str(path), "1", "10"], capture_output=True, text=True,
                           timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    holder = subprocess.Popen([sys.executable, HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    after = subprocess.run([sys.executable, PUT_FETCH, str(path), "2", "10"], capture_output=True, text=True,
                           timeout=60)  # a lock-up fails here as TimeoutExpired
    assert after.returncode == 0 and "ok 10" in after.stdout, after.stdout + after.stderr
    import lmdb
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"half-written", db=env.open_db(b"blocks", txn=txn, create=False)) is None
    env.close()
    rc, out = D.run_verify(path)
    assert rc == 0, out
    _check_store(path, [D.writer_prompt(s, i) for s in (1, 2) for i in range(10)], [])


def test_kill_one_of_two_writers_inside_a_flush(tmp_path):
    """Two processes write one store; one is killed inside its flush (often
    holding the write lock) again and again: the other never stalls."""
    path = tmp_path / "store"
    steady_log = tmp_path / "steady.log"
    steady = _start_writer(path, steady_log, 500)
    try:
        _wait_ready(steady, steady_log)
        for r in range(4):
            log = tmp_path / f"victim-{r}.log"
            victim = _start_writer(path, log, 600 + r)
            try:
                _wait_ready(victim, log)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:  # kill right after a flush starts
                    lines = log.read_text().splitlines()
                    if lines and lines[-1].startswith("F ") and len(lines) > 3:
                        break
                    time.sleep(0.001)
            finally:
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=30)
                victim.stderr.close()
            before = _read_log(steady_log)[0]
            deadline = time.monotonic() + 30
            while _read_log(steady_log)[0] < before + 3:
                assert steady.poll() is None, steady.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "the surviving writer stalled after the other was killed"
                time.sleep(0.01)
            assert not _read_log(log)[2]
    finally:
        steady.send_signal(signal.SIGKILL)
        steady.wait(timeout=30)
        steady.stderr.close()
    assert not _read_log(steady_log)[2], _read_log(steady_log)[2]
    flushed = [(500, i) for i in range(_read_log(steady_log)[0] + 1)]
    flushed += [(600 + r, i) for r in range(4) for i in range(_read_log(tmp_path / f"victim-{r}.log")[0] + 1)]
    _check_store(path, [D.writer_prompt(s, i) for s, i in flushed], [])
    rc, out = D.run_verify(path)
    assert rc == 0, out
