"""Restarts: what one process put, a new process fetches back exactly, whether
the writer closed its store or simply exited (the atexit hook flushes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import StoreClosedError
from kvstore.store import PrefixStore

from . import _restart_child as child
from ._helpers import assert_hit_is, kv_layers

ROOT = Path(__file__).resolve().parent.parent


def run_child(mode: str, path: Path) -> dict:
    # the repository first, then whatever the parent had (the GPU machine finds mlx through PYTHONPATH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "tests._restart_child", mode, str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"child {mode} failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected_blocks() -> int:
    seen = set()
    for p in child.prompts():
        seen |= {tuple(p[: min(i + child.BS, len(p))]) for i in range(0, len(p), child.BS)}
    return len(seen)


def test_closed_store_is_read_back_by_a_new_process(tmp_path):
    """Put + close() in one process; a new process (with other kv_bits)
    fetches every prompt back bit-exact, from SSD."""
    path = tmp_path / "store"
    run_child("write-close", path)
    got = run_child("read", path)
    assert got == {"blocks": expected_blocks(), "orphans": 0}


def test_exit_without_close_is_flushed_at_exit(tmp_path):
    """A process that exits with writes still queued and never calls close()
    loses nothing: the atexit hook flushes and closes the store."""
    path = tmp_path / "store"
    wrote = run_child("write-exit", path)
    assert wrote["pending_bytes"] > 0  # the writes really were still queued at exit
    got = run_child("read", path)
    assert got == {"blocks": expected_blocks(), "orphans": 0}


def test_open_store_sees_blocks_another_process_writes(tmp_path):
    """A store already open in this process finds blocks another process
    writes to the same path afterwards (LMDB is shared), exactly."""
    path = tmp_path / "store"
    with PrefixStore(budget_gb=1, ssd_path=path, block_size=child.BS) as mine:
        assert not mine.fetch(child.MODEL, child.prompts()[1])
        run_child("write-close", path)
        for p in child.prompts():
            assert_hit_is(mine.fetch(child.MODEL, p), p, len(p), heads=2, dim=child.DIM)


def test_reopen_in_process_after_close(tmp_path):
    """Within one process, close() then a new PrefixStore on the path serves
    everything; a second close() is harmless and a closed store refuses use."""
    path = tmp_path / "store"
    store = PrefixStore(budget_gb=1, ssd_path=path, block_size=child.BS)
    for p in child.prompts():
        store.put(child.MODEL, p, child.layers(p))
    store.close()
    store.close()
    with pytest.raises(StoreClosedError, match="closed"):
        store.fetch(child.MODEL, child.prompts()[0])
    with pytest.raises(StoreClosedError):
        store.put(child.MODEL, [1], kv_layers([1]))
    with PrefixStore(budget_gb=1, ssd_path=path, block_size=child.BS) as again:
        assert len(again) == expected_blocks()
        for p in child.prompts():
            assert_hit_is(again.fetch(child.MODEL, p), p, len(p), heads=2, dim=child.DIM)
