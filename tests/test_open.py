"""Opening a store: one environment per path per process, shared by every
``PrefixStore`` of that path there, and none kept alive by a store dropped
unclosed; a private directory for a new store; read-only opens that need
nothing written and refuse writes; paths that are not stores refused; errors
that say what is wrong and never advise deleting a healthy store; an open
that reads the index, not the blocks around it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import traceback
from pathlib import Path

import pytest

from kvstore import PrefixStore, ReadOnlyError, StoreOpenError
from kvstore.tiers.disk.lmdb import LmdbTier

from ._helpers import assert_hit_is, kv_layers, put

BS = 8
M = "test-model"
NOBODY = 65534


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_a_second_store_on_a_path_open_in_this_process_shares_it(tmp_path):
    """A re-run notebook cell opens the same ``ssd_path`` while the first
    store is still open: both work, see each other's blocks, and closing one
    leaves the other serving."""
    path = tmp_path / "store"
    a = PrefixStore(ssd_path=path, block_size=BS)
    p = toks(3 * BS)
    a.put(M, p, kv_layers(p))
    a.flush()
    b = PrefixStore(ssd_path=path, block_size=BS)
    assert_hit_is(b.fetch(M, p), p, len(p))
    q = toks(BS) + toks(2 * BS, start=7)
    b.put(M, q, kv_layers(q))
    b.flush()
    assert_hit_is(a.fetch(M, q), q, len(q))
    a.close()
    assert_hit_is(b.fetch(M, p), p, len(p))
    b.close()
    with PrefixStore(ssd_path=path, block_size=BS) as c:  # and the path is free again once both closed
        assert_hit_is(c.fetch(M, q), q, len(q))


def test_a_path_open_read_only_in_this_process_is_not_reopened_writable(tmp_path):
    path = tmp_path / "store"
    PrefixStore(ssd_path=path).close()
    with PrefixStore(ssd_path=path, readonly=True):
        with pytest.raises(StoreOpenError, match="already open read-only in this process") as e:
            PrefixStore(ssd_path=path)
    assert "delete" not in str(e.value) and "corrupt" not in str(e.value)
    with PrefixStore(ssd_path=path, readonly=True) as r, PrefixStore(ssd_path=path, readonly=True) as s:
        assert r.stats()["ssd_path"] == s.stats()["ssd_path"]


# ------------------------------------------------------------ permissions


def as_unprivileged(fn):
    """``fn()`` in a forked child as a user file modes apply to (``nobody``
    when the tests run as root): ``("ok", repr(result))`` or
    ``(exception type, message)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            try:
                out = ["ok", repr(fn())]
            except BaseException as e:
                out = [type(e).__name__, str(e)]
            os.write(w, json.dumps(out).encode())
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(got))


@pytest.fixture
def open_dir():
    """A directory every user can reach (pytest's own tmp_path is private to its user)."""
    d = Path(tempfile.mkdtemp(prefix="kvstore-open-"))
    os.chmod(d, 0o755)
    yield d
    for root, dirs, _ in os.walk(d):
        for x in dirs:
            os.chmod(os.path.join(root, x), stat.S_IRWXU)
    shutil.rmtree(d)


def _readable_by_all(path):
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


def test_a_store_whose_lock_file_this_user_cannot_write_opens_read_only(open_dir):
    """A store of another user (its files readable, not writable): a
    read-only open serves it; a writable one says to open it read-only, which
    then works (it answered that advice with the same error)."""
    path = open_dir / "store"
    p = toks(2 * BS)
    with PrefixStore(ssd_path=path, block_size=BS) as s:
        s.put(M, p, kv_layers(p))
    _readable_by_all(open_dir)
    os.chmod(path / "lock.mdb", 0o444)

    def read():
        with PrefixStore(ssd_path=path, block_size=BS, readonly=True) as s:
            return s.contains(M, p)

    def write():
        PrefixStore(ssd_path=path, block_size=BS)

    assert as_unprivileged(read) == ("ok", repr(len(p)))
    kind, msg = as_unprivileged(write)
    assert kind == "StoreOpenError" and "read-only" in msg and "delete" not in msg


def test_a_store_directory_this_user_cannot_enter_is_a_store_open_error(open_dir):
    locked = open_dir / "locked"
    locked.mkdir(mode=0o000)
    for path in (locked, locked / "store"):
        kind, msg = as_unprivileged(lambda: PrefixStore(ssd_path=path))
        assert kind == "StoreOpenError" and str(locked) in msg and "permission" in msg.lower(), (kind, msg)


def test_lmdb_tier_open_shares_and_counts_its_users(tmp_path):
    path = tmp_path / "store"
    a = LmdbTier.open(path, 1 << 30)
    b = LmdbTier.open(path)
    assert a is b and a.users == 2
    b.close()
    assert a.env.stat()["psize"] > 0  # still open
    a.close()
    c = LmdbTier.open(path)
    assert c is not a
    c.close()


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "read-only"])
def test_opening_a_store_reads_its_index_not_the_blocks_around_it(tmp_path, readonly):
    """The index's pages lie among the blocks' values: read with the
    kernel's read-around (8 MiB a page fault on some machines) an open
    brought a fifth of a store's blocks into the page cache. Opened after
    its file left the page cache, a store has read almost none of it, and
    its first fetch is a cold one."""
    from kvstore.tools.bench.common import drop_page_cache, resident_fraction

    p = toks(64 * 64)
    with PrefixStore(ssd_path=tmp_path / "s", budget_gb=0, block_size=64) as s:
        s.put(M, p, kv_layers(p, n_layers=8, heads=4, dim=64))  # 64 blocks of 0.5 MiB
    data = tmp_path / "s" / "data.mdb"
    for _ in range(2):  # (a second open after a close and a fetch alike)
        drop_page_cache(data)
        if resident_fraction(data) > 0.5:
            pytest.skip("this file system keeps files in memory (tmpfs): its page cache cannot be dropped")
        with PrefixStore(ssd_path=tmp_path / "s", budget_gb=0, block_size=64, readonly=readonly) as s:
            # none of the kernel's read-around (8 MiB a fault here: a quarter of this file); a loaded box left up
            # to 4% resident once (1 of 4 full suite runs), its own pages and what writeback had not let go
            assert resident_fraction(data) < 0.1
            assert s.fetch(M, p[: 64 * 8]).length == 64 * 8
        assert resident_fraction(data) > 0.1


def test_store_directory_is_private(tmp_path):
    """The store directory is created with mode 0o700 (parents as needed), its files 0o600."""
    path = tmp_path / "a" / "b" / "store"
    with PrefixStore(budget_gb=1, ssd_path=path, block_size=BS) as s:
        put(s, toks(8))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((path / "data.mdb").stat().st_mode) == 0o600


def test_foreign_paths_are_refused(tmp_path):
    """ssd_path must be new, empty or a kvstore store: a file or a directory
    of other files is refused with StoreOpenError, and left untouched."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreOpenError, match="is a file"):
        PrefixStore(ssd_path=f)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    with pytest.raises(StoreOpenError, match="not a kvstore store"):
        PrefixStore(ssd_path=d)
    assert f.read_text() == "x" and sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_readonly_store_serves_but_refuses_writes(ssd, tmp_path):
    """A read-only store fetches what is on disk and refuses put."""
    p = toks(20)
    s = ssd()
    put(s, p)
    s.close()
    ro = ssd(readonly=True)
    assert_hit_is(ro.fetch(M, p), p, 20)
    with pytest.raises(ReadOnlyError, match="read-only"):
        put(ro, p)
    with pytest.raises(ReadOnlyError):
        ro.clear()
    with pytest.raises(StoreOpenError):
        PrefixStore(ssd_path=tmp_path / "missing", readonly=True)


def test_a_writable_store_dropped_unclosed_leaves_its_path_free(tmp_path):
    """Opening a store starts no thread that keeps it alive: one dropped
    without close() (and never written to) is collected, and its path opens
    again in the same process."""
    import gc

    s = PrefixStore(budget_gb=1, block_size=BS, ssd_path=tmp_path / "store")
    del s
    gc.collect()
    again = PrefixStore(budget_gb=1, block_size=BS, ssd_path=tmp_path / "store")
    again.close()
