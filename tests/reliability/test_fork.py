"""A store opened before ``fork()`` (multiprocessing's default start method on
Linux before Python 3.14, pre-fork servers) works in parent and child at once.
LMDB's rule is never to use an environment across ``fork()``: the child
reopens it at its first use (as diskcache reopens its connection)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_parent_and_child_of_a_fork_write_and_read_the_store_each_through_its_own_environment(tmp_path):
    """Both put prompts of their own and read the shared one, their own and
    the other's, exactly; each process's reads are registered under its own
    pid in LMDB's reader table (through the parent's environment, the
    child's were registered under the parent's pid); the store verifies
    clean afterwards."""
    store = tmp_path / "store"
    p = subprocess.run([sys.executable, str(HERE / "child_fork_both.py"), str(store)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    lines = sorted(l for l in p.stdout.splitlines() if l.startswith(("parent", "child")))
    assert lines == ["child own ok", "parent own ok"], p.stdout + p.stderr[-3000:]
    v = subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", "verify", str(store)],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_child_of_a_fork_fetches_a_one_layer_prompt_its_parent_stored(tmp_path):
    """A one-layer fetch runs in the calling thread, on its default CPU
    stream; the child's copy of the parent's had no mlx thread behind it, so
    the fetch never returned (more layers ran on the pool's new threads). The
    child gets the whole prompt, exactly; a hang is killed by the script."""
    p = subprocess.run([sys.executable, str(HERE / "child_fork_one_layer.py"), str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert [l for l in p.stdout.splitlines() if l.startswith("child")] == ["child 100 None"], p.stdout + p.stderr[-3000:]
