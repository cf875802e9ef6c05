"""Nothing lost on close: ``close()`` and interpreter exit (atexit, in a child
that puts and just exits) write every pending block; a fetch after reopening
returns them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import PrefixStore

from . import kvdata as D

HERE = Path(__file__).resolve().parent


def _all_there(path: Path, prompts: list, model: str) -> None:
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK) as store:
        for i, toks in enumerate(prompts):
            hit = store.fetch(model, toks)
            assert hit.length == len(toks), f"prompt {i}: {hit.length} of {len(toks)} tokens after reopening"
            assert D.hit_problem(hit, toks) is None


def test_close_writes_pending_blocks(tmp_path):
    path = tmp_path / "store"
    prompts = [D.tokens(60_000 + i, 100) for i in range(80)]
    store = PrefixStore(budget_gb=0.1, ssd_path=path, block_size=D.BLOCK)
    pending = 0
    for toks in prompts:
        store.put("close-model", toks, D.layers_for(toks))
        pending = max(pending, store.stats()["pending_jobs"])
    store.close()
    store.close()  # idempotent
    assert pending > 0, "no put was pending: the test did not test close()"
    _all_there(path, prompts, "close-model")


@pytest.mark.parametrize("how", ["return", "sys_exit", "exception", "dropped"])
def test_interpreter_exit_writes_pending_blocks(tmp_path, how):
    path = tmp_path / "store"
    n = 60
    p = subprocess.run([sys.executable, str(HERE / "child_exit.py"), str(path), str(n), how],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == (1 if how == "exception" else 0), p.stdout + p.stderr[-3000:]
    assert "Traceback" not in p.stderr or how == "exception", p.stderr[-3000:]
    assert "pending" in p.stdout
    _all_there(path, [D.tokens(70_000 + i, 100) for i in range(n)], "exit-model")


def test_a_forked_child_writes_its_puts_with_threads_of_its_own(tmp_path):
    """A store whose writer and commit threads ran in the parent, used in a
    forked child: the child's put is written (it hung: the child's new thread
    never got the job, the parent's vanished thread was woken instead)."""
    p = subprocess.run([sys.executable, str(HERE / "child_fork.py"), str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("child"))
    _, pending, blocks, length, problem = line.split(maxsplit=4)
    assert (pending, length, problem) == ("0", "100", "None") and int(blocks) >= 2 * 100 // D.BLOCK
