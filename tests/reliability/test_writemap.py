"""Writable map (LMDB ``writemap``): a new store is mapped writable and says
so in its format record; every process of the store opens it the same way,
and two processes growing its map while they read each other's blocks serve
them exactly; its file is allocated before the map covers it, so it never has
a hole a write through the map could fault on (on a full device, SIGBUS). A
store made without the flag (format 3) keeps default flags in every process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgpack

from kvstore import PrefixStore
from kvstore.tiers.disk.lmdb_layout import FORMAT_VERSION

from . import kvdata as D

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def _format(path: Path) -> dict:
    env = D.open_env(path, readonly=True)
    try:
        with env.begin() as txn:
            return msgpack.unpackb(txn.get(b"format", db=env.open_db(b"meta", create=False, txn=txn)))
    finally:
        env.close()


def _holes(path: Path) -> int:
    """Bytes of data.mdb without disk blocks."""
    st = os.stat(path / "data.mdb")
    return max(0, st.st_size - st.st_blocks * 512)


def _run_growers(path: Path, sync: Path, rounds: int, n: int, workers: int = 2) -> list[str]:
    sync.mkdir()
    outs = D.run_workers("child_grower.py", lambda w: (path, sync, w, workers, rounds, n), workers, 240)
    rc, text = D.run_verify(path)
    assert rc == 0 and ", 0 bad" in text, text
    return outs


def _all_served(path: Path, rounds: int, n: int, workers: int = 2, **kw) -> None:
    sys.path.insert(0, str(HERE))
    try:
        import child_grower
    finally:
        sys.path.remove(str(HERE))
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK, **kw) as store:
        for r in range(rounds):
            for w in range(workers):
                toks = child_grower.prompt(w, r, n)
                hit = store.fetch(child_grower.MODEL, toks)
                assert hit.length == n and D.hit_problem(hit, toks) is None, (w, r, hit.length)


def test_two_processes_grow_one_writemap_store(tmp_path, figures):
    path, rounds, n = tmp_path / "store", 8, 2048  # 1 MiB of KV per prompt: the map grows several times
    outs = _run_growers(path, tmp_path / "sync", rounds, n)
    assert all(o.startswith("writemap True") for o in outs), outs
    fmt = _format(path)
    assert fmt["version"] == FORMAT_VERSION and fmt["writemap"] is True, fmt
    size = os.path.getsize(path / "data.mdb")
    assert size >= 2 * rounds * MiB, f"the map never grew ({size} bytes)"
    assert _holes(path) == 0, f"data.mdb has {_holes(path)} bytes of holes"
    _all_served(path, rounds, n)
    _all_served(path, rounds, n, readonly=True)
    fetches = sum(int(o.split()[-1]) for o in outs)
    figures(f"2 processes, {rounds} rounds, file grown to {size / MiB:.0f} MiB with no holes: "
            f"{fetches} cross-process fetches of 1 MiB prompts, all exact")


def test_store_made_without_writemap_keeps_default_flags(tmp_path):
    """A format-3 store (written with default flags: its file ends at its last
    page, its format record has no flag) opens with default flags in every
    process, takes puts from two processes at once, and stays format 3."""
    made, old = tmp_path / "made", tmp_path / "old"
    toks = D.tokens(7, 300)
    with PrefixStore(ssd_path=made, block_size=D.BLOCK) as store:
        store.put("m", toks, D.layers_for(toks))
    old.mkdir()
    env = D.open_env(made)
    env.copy(str(old), compact=True)  # a file as default flags leave it: no allocated tail
    env.close()
    env = D.open_env(old)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        fmt = msgpack.unpackb(txn.get(b"format", db=meta))
        fmt = {k: v for k, v in fmt.items() if k != "writemap"}
        txn.put(b"format", msgpack.packb(dict(fmt, version=3)), db=meta)
    env.close()
    outs = _run_growers(old, tmp_path / "sync", 3, 1024)
    assert all(o.startswith("writemap False") for o in outs), outs
    fmt = _format(old)
    assert fmt["version"] == 3 and "writemap" not in fmt, fmt
    _all_served(old, 3, 1024)
    with PrefixStore(ssd_path=old, block_size=D.BLOCK, readonly=True) as ro:
        hit = ro.fetch("m", toks)
        assert hit.length == len(toks) and D.hit_problem(hit, toks) is None
