"""Foreign and old files at ``ssd_path``: a plain file, a directory of other
files, an LMDB environment of another program, a kvstore store of another
format version. Each gives a ``StoreOpenError`` that names the path and says
what to do, and nothing of the user's is written to.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import lmdb
import msgpack
import pytest

from kvstore import PrefixStore, StoreOpenError
from kvstore.tiers.disk.lmdb_layout import FORMAT_VERSION

from . import kvdata as D


def _snapshot(root: Path, skip=("lock.mdb",)) -> dict:
    """Bytes, mode and mtime of every file under ``root`` (or of ``root``)."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode) for p in files if p.name not in skip}


def _age(root: Path) -> None:
    """Set mtimes in the past so any write would show."""
    old = time.time() - 3600
    for p in [root, *root.rglob("*")] if root.is_dir() else [root]:
        os.utime(p, (old, old))


def _expect_open_error(path: Path, *phrases: str) -> str:
    for kwargs in ({}, {"readonly": True}):
        with pytest.raises(StoreOpenError) as e:
            PrefixStore(ssd_path=path, **kwargs)
        msg = str(e.value)
        assert str(path) in msg, msg
        for ph in phrases:
            assert ph in msg, msg
    for cmd in (["verify", str(path)], ["inspect", str(path)], ["verify", str(path), "--repair"]):
        p = subprocess.run(D.kvstore_cli() + cmd, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, COLUMNS="300"))
        assert p.returncode == 2 and str(path) in " ".join((p.stdout + p.stderr).split()) \
            and "Traceback" not in p.stderr, (cmd, p.returncode, p.stdout, p.stderr)
    return msg


def test_plain_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"my notes\n" * 100)
    _age(path)
    before = _snapshot(path)
    msg = _expect_open_error(path, "is a file", "directory")
    assert _snapshot(path) == before
    assert "nothing was written" in msg


def test_directory_of_something_else(tmp_path):
    path = tmp_path / "photos"
    (path / "2024").mkdir(parents=True)
    (path / "a.jpg").write_bytes(os.urandom(5000))
    (path / "2024" / "b.jpg").write_bytes(os.urandom(3000))
    _age(path)
    before = _snapshot(path)
    names = sorted(p.name for p in path.rglob("*"))
    _expect_open_error(path, "not a kvstore store", "empty or new directory")
    assert _snapshot(path) == before
    assert sorted(p.name for p in path.rglob("*")) == names  # no data.mdb / lock.mdb created


def _foreign_env(path: Path, named_dbs: bool, names=(b"users", b"orders")) -> None:
    env = lmdb.open(str(path), max_dbs=8, map_size=16 << 20)
    if named_dbs:
        for name in names:
            db = env.open_db(name)
            with env.begin(write=True) as txn:
                for i in range(200):
                    txn.put(b"k%05d" % i, os.urandom(50), db=db)
    else:
        with env.begin(write=True) as txn:
            for i in range(500):
                txn.put(b"user:%05d" % i, os.urandom(80))
    env.close()


@pytest.mark.parametrize("layout", ["main_db", "named_dbs", "named_dbs_with_a_meta_db"])
def test_lmdb_environment_of_another_program(tmp_path, layout):
    path = tmp_path / "app-db"
    _foreign_env(path, layout != "main_db",
                 (b"users", b"meta") if layout == "named_dbs_with_a_meta_db" else (b"users", b"orders"))
    _age(path)
    before = _snapshot(path)
    msg = _expect_open_error(path)
    assert "another program" in msg or "not a kvstore store" in msg, msg
    assert "nothing was written" in msg, msg
    assert "delete" not in msg.lower(), msg  # never advise deleting another program's data
    assert _snapshot(path) == before


def _store_with_format(path: Path, fmt: dict) -> None:
    toks = D.tokens(1, 40)
    with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
        store.put("m", toks, D.layers_for(toks))
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(b"meta", create=False)
    with env.begin(write=True) as txn:
        txn.put(b"format", msgpack.packb(fmt), db=meta)
    env.close()


@pytest.mark.parametrize("fmt", [{"name": "kvstore", "version": FORMAT_VERSION + 1},
                                 {"name": "kvstore", "version": 1},
                                 {"name": "other-cache", "version": FORMAT_VERSION}, {}])
def test_store_of_another_format_version(tmp_path, fmt):
    path = tmp_path / "store"
    _store_with_format(path, fmt)
    _age(path)
    before = _snapshot(path)
    msg = _expect_open_error(path, f"this kvstore reads kvstore/{FORMAT_VERSION}")
    assert f"{fmt.get('name')}/{fmt.get('version')}" in msg
    assert "new ssd_path" in msg
    assert _snapshot(path) == before
    for cmd in re.findall(r"`(kvstore [^`]+)`", msg):  # a command it suggests must do what it says
        p = subprocess.run(D.kvstore_cli() + cmd.split()[1:], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"the suggested `{cmd}` fails: {p.stdout}{p.stderr}"
        with PrefixStore(ssd_path=path, block_size=D.BLOCK):
            pass
        return
    # what the message says to do works: a new ssd_path, or deleting the directory
    toks = D.tokens(2, 40)
    for fresh in (tmp_path / "new-store", None):
        if fresh is None:
            import shutil
            shutil.rmtree(path)
            fresh = path
        with PrefixStore(ssd_path=fresh, block_size=D.BLOCK) as store:
            store.put("m", toks, D.layers_for(toks))
        with PrefixStore(ssd_path=fresh, block_size=D.BLOCK) as store:
            hit = store.fetch("m", toks)
            assert hit.length == len(toks) and D.hit_problem(hit, toks) is None


_LETTERS = {"parent": "p", "root": "r", "start": "s", "length": "n", "tokens": "t", "nbytes": "b", "first": "f",
            "snap": "sn", "gap": "g", "rows_from": "wf", "created": "c", "used": "u", "hits": "h", "kv": "kv",
            "dtype": "dt"}


def _as_format2(path) -> int:
    """Rewrite a store as kvstore 0.1 wrote it: format 2, single-letter records."""
    env = lmdb.open(str(path), max_dbs=8)
    nodes, meta = env.open_db(b"nodes", create=False), env.open_db(b"meta", create=False)
    n = 0
    with env.begin(write=True) as txn:
        for k, v in list(txn.cursor(db=nodes)):
            rec = msgpack.unpackb(v)
            old = {_LETTERS[f]: x for f, x in rec.items() if f in _LETTERS and not (f == "rows_from" and x < 0)}
            txn.put(k, msgpack.packb(old), db=nodes)
            n += 1
        fmt = msgpack.unpackb(txn.get(b"format", db=meta))
        txn.put(b"format", msgpack.packb(dict(fmt, version=2)), db=meta)
    env.close()
    return n


def _format_version(path) -> int:
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    with env.begin() as txn:
        v = msgpack.unpackb(txn.get(b"format", db=env.open_db(b"meta", create=False, txn=txn)))["version"]
    env.close()
    return v


def test_format2_store_is_read_then_marked_as_this_format(tmp_path):
    """Stores of the previous format (single-letter index records) keep
    working: read-only opens leave them as they are; the first writable open
    serves every prompt exactly and marks the store as this format, so an older
    kvstore refuses it rather than misread new records."""
    path = tmp_path / "store"
    prompts = [D.tokens(i, 40 + 17 * i) for i in range(3)]
    with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
        for p in prompts:
            store.put("m", p, D.layers_for(p))
    assert _as_format2(path) == sum(-(-len(p) // D.BLOCK) for p in prompts)
    with PrefixStore(ssd_path=path, block_size=D.BLOCK, readonly=True) as ro:
        assert all(D.hit_problem(ro.fetch("m", p), p) is None for p in prompts)
    assert _format_version(path) == 2
    with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
        for p in prompts:
            hit = store.fetch("m", p)
            assert hit.length == len(p) and D.hit_problem(hit, p) is None
        more = D.tokens(9, 50)
        store.put("m", more, D.layers_for(more))
    assert _format_version(path) == FORMAT_VERSION
    res = subprocess.run(D.kvstore_cli() + ["verify", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_store_another_process_is_creating_opens(tmp_path):
    """A new store's process reserves the lock file before LMDB writes data.mdb:
    a second process opening the directory in that moment sees only lock.mdb,
    which is a store being made, not a foreign directory."""
    path = tmp_path / "store"
    path.mkdir()
    (path / "lock.mdb").write_bytes(b"")
    toks = D.tokens(4, 40)
    with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
        store.put("m", toks, D.layers_for(toks))
    with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
        assert D.hit_problem(store.fetch("m", toks), toks) is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(StoreOpenError, match="not a kvstore store"):
        PrefixStore(ssd_path=tmp_path / "other")
