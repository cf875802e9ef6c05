"""Opening an LMDB environment for the tier: one per store path per process,
its flags and map, the map's growth, and the transactions every tier
operation runs in.

New stores are written through a writable map (LMDB's ``writemap``): a value
is copied once, into the file's pages, instead of into LMDB's buffers and then
the file (docs/design-notes.md, "LMDB tier"). A store on a writable map must
never touch a hole of its file: on a full device that is SIGBUS, not an
error. So the file is the map, allocated with ``posix_fallocate`` before the
map covers it (at open, ahead of a batch that would not fit, on
``MapFullError``); an allocation that fails is the full-disk path. LMDB
truncates the file to the size a process maps, so no process maps less than
the file holds, and opening or changing the map happens under the gate's lock
across processes. Every process of a store must use the same flag: the format
record says which; stores made without it keep default flags.

Map size grows on ``MapFullError``; another process growing it is adopted on
``MapResizedError``. LMDB allows an environment once per process and never
across ``fork()``: ``LmdbEnv.open`` shares one per path, and a forked child
reopens its own at first use.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import lmdb

from ...errors import StorageError, StoreOpenError
from .gate import Gate
from .lmdb_layout import (DBS, FORMAT_VERSION, MAX_READERS, allocate, check_dir, open_dbs, pack,
                          reserve_lock_file, unpack)
from .residency import map_base, without_read_around
from .users import note_user

log = logging.getLogger("kvstore")
_T = TypeVar("_T", bound="LmdbEnv")

_MIN_MAP = 64 << 20  # default flags: the map is only address space
_NEW_MAP = 1 << 20  # a writable map's first size (its file is allocated to the map: it starts small)
_GROW_MIN = 1 << 20
_GROW_MAX = 1 << 30  # a writable map grows by half, at most this much: the file holds what it maps
_CAN_ALLOCATE = hasattr(os, "posix_fallocate")  # without it (macOS) stores keep default flags
_LOW_SPACE = 1 << 20


def is_disk_full(e: BaseException) -> bool:
    """Whether an error is the device being full (ENOSPC, from LMDB or the OS)."""
    return isinstance(e, lmdb.Error) and ("No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC) \
        or isinstance(e, OSError) and e.errno == errno.ENOSPC


def _file_key(path: Path) -> Optional[tuple[int, int]]:
    """What identifies a store's data file in this process (``None``: there is none yet)."""
    try:
        st = os.stat(path / "data.mdb")
    except OSError:
        return None
    return st.st_dev, st.st_ino


_SHARED: dict[tuple[int, int], "LmdbEnv"] = {}  # each store open in this process, by its data file
_SHARED_LOCK = threading.Lock()
_AFTER_FORK = threading.Lock()  # one thread of a forked child reopens a tier


def _reset_after_fork() -> None:
    global _SHARED_LOCK, _AFTER_FORK
    _SHARED_LOCK, _AFTER_FORK = threading.Lock(), threading.Lock()  # a parent's thread may have held them


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class LmdbEnv:
    """One LMDB environment (``LmdbTier`` adds the block operations). ``open``
    is how the store gets one: LMDB allows an environment once per process,
    so every ``PrefixStore`` of one path in a process shares one tier (closed
    with the last of them). A tier used in a child of ``fork()`` reopens its
    environment there first (LMDB's rule: never use an environment across
    ``fork()``)."""

    @classmethod
    def open(cls: type[_T], path, budget_bytes: Optional[int] = None, readonly: bool = False) -> _T:
        """The tier of ``path`` this process has open, or a new one; each
        ``open`` needs its ``close``. A path open read-only here is not opened
        again writable (``StoreOpenError`` says so)."""
        with _SHARED_LOCK:
            key = _file_key(Path(path).expanduser())
            tier = _SHARED.get(key) if key is not None else None
            if tier is not None:
                if tier.readonly and not readonly:
                    raise StoreOpenError(
                        f"{tier.path} is already open read-only in this process (another PrefixStore). Close "
                        f"that one first (store.close()), or open this one read-only too.")
                tier.users += 1
                if budget_bytes is not None and not tier.readonly:
                    tier.budget = int(budget_bytes)
                return tier
            tier = cls(path, budget_bytes, readonly)
            key = _file_key(tier.path)
            if key is not None:
                _SHARED[key] = tier
            return tier

    def __init__(self, path, budget_bytes: Optional[int] = None, readonly: bool = False):
        self.path = Path(path).expanduser()
        self._data_file = str(self.path / "data.mdb")
        self._span: Optional[tuple[int, int]] = None  # where LMDB maps the data file here
        self._page_size: Optional[int] = None
        self.readonly = readonly
        self.users = 1  # stores of this process using it (see ``open``)
        self._pid = os.getpid()
        self._gate_here = Gate()
        check_dir(self.path, readonly)
        self.budget = int(budget_bytes) if budget_bytes is not None else self._default_budget()
        self.dbs = {}
        self.writemap = False
        fmt = self._open_env()
        if readonly:
            return
        try:
            with self.own_pages_only():  # (two small records)
                if fmt["version"] == 2:
                    # records of both formats are read; once this kvstore writes, an older one must not open it
                    # (it would take the new records for damaged ones)
                    self.set_info("format", dict(fmt, version=FORMAT_VERSION, upgraded=time.time(),
                                                 writemap=False))
                self.set_info("budget", self.budget)
                note_user(self, True)
        except (lmdb.Error, OSError) as e:
            if not self.is_full(e):
                self._env.close()
                raise StoreOpenError(f"{self.path}: cannot write to the store ({e}). Check the device "
                                     f"and its permissions, or open it read-only.") from None
            log.warning("kvstore: %s is full: the store opens, but new blocks stay in RAM until space is freed",
                        self.path)

    def _open_env(self) -> Optional[dict]:
        """Open the environment and its sub-databases; the format record (``None`` read-only)."""
        if self.readonly:
            self._env = self._open(True)
            open_dbs(self._env, self.dbs, self.path, self.readonly, self.writemap)
            return None
        self._gate_here.lock_dir = self.path  # other processes wait while this one opens, creates or resizes
        with self._gate_here.exclusive():
            fmt = self._stored_format()
            self.writemap = _CAN_ALLOCATE and (fmt is None or bool(fmt.get("writemap")))
            self._env = self._open(False, self.writemap)
            return open_dbs(self._env, self.dbs, self.path, self.readonly, self.writemap)

    @property
    def env(self) -> lmdb.Environment:
        """This process's environment (reopened first in a child of ``fork()``)."""
        if self._pid != os.getpid():
            self._reopen()
        return self._env

    @property
    def _gate(self) -> Gate:
        if self._pid != os.getpid():
            self._reopen()
        return self._gate_here

    def _reopen(self) -> None:
        """In a child of ``fork()``, at its first use of the tier: close the
        parent's environment here (LMDB then releases only what this process
        holds: the parent's readers and locks stay the parent's) and open the
        store anew. A parent's thread may have held the gate at the fork: the
        child starts with a gate of its own."""
        with _AFTER_FORK:
            if self._pid == os.getpid():
                return
            try:
                self._env.close()
            except lmdb.Error:
                pass
            self._gate_here, self._span = Gate(), None
            self.dbs.clear()
            self._open_env()
            self._pid = os.getpid()

    def _default_budget(self) -> int:
        """Half the free space where the store lives, at most 64 GiB."""
        free = shutil.disk_usage(self.path if self.path.exists() else self.path.parent).free
        return int(min(64 << 30, free // 2))

    def _stored_format(self) -> Optional[dict]:
        """The format record of an existing store (``None`` for a new or empty
        one), read on a read-only open: a writable one could change the file
        (LMDB extends a writable map's file to the map) before it is checked."""
        data = self.path / "data.mdb"
        if not data.exists() or data.stat().st_size == 0:
            return None
        env = self._open(True)
        try:
            return open_dbs(env, {}, self.path, self.readonly, False, probe=True)
        finally:
            env.close()

    def _open(self, readonly: bool, writemap: bool = False) -> lmdb.Environment:
        data = self.path / "data.mdb"
        size = data.stat().st_size if data.exists() else 0
        if writemap:
            map_size = max(_NEW_MAP, size)  # never below the file: LMDB truncates it to the map
        else:
            map_size = max(_MIN_MAP, size, min(self.budget + self.budget // 4, 1 << 40))
        reserve_lock_file(self.path)
        lock = not self.readonly or self._lock_writable()
        try:
            # readahead stays on: values are multi-MiB runs read whole (docs/design-notes.md, "LMDB tier")
            env = lmdb.open(str(self.path), map_size=map_size, subdir=True, max_dbs=len(DBS) + 1,
                            readonly=readonly, metasync=False, readahead=True, mode=0o600,
                            max_readers=MAX_READERS, lock=lock, writemap=writemap)
        except lmdb.Error as e:
            if isinstance(e, lmdb.ReadonlyError) or "Permission denied" in str(e):
                raise StoreOpenError(f"{self.path}: the store is not writable by this user. Open it read-only "
                                     f"(readonly=True; `kvstore inspect`, `stats` and `verify` do) or fix its "
                                     f"permissions.") from None
            if "already open in this process" in str(e):  # not through kvstore: LmdbEnv.open shares its own
                raise StoreOpenError(f"{self.path}: this process already has the store open outside kvstore "
                                     f"(an lmdb.Environment): close that first.") from None
            raise StoreOpenError(f"{self.path}: not a readable LMDB store ({e}). It is corrupt or foreign: "
                                 f"move it away or delete it (`kvstore clear --all` cannot repair it).") from None
        if readonly and size:  # (a writable open of an existing store was checked read-only first)
            info = env.info()
            # stat again: another process may have committed (and grown the file) since the size above
            size = data.stat().st_size
            if (info["last_pgno"] + 1) * env.stat()["psize"] > size:
                env.close()
                raise StoreOpenError(f"{self.path}: data.mdb is truncated ({size} bytes, needs "
                                     f"{(info['last_pgno'] + 1) * 4096}). Delete the store directory to start over.")
        if writemap:
            try:
                # LMDB made the file as large as the map, with holes (a new store's, or one left by a
                # process killed here): give it its blocks before a page is written through the map
                allocate(self.path, env.info()["map_size"])
            except OSError as e:
                env.close()
                if e.errno == errno.ENOSPC:
                    raise StoreOpenError(f"{self.path}: no space left on its device. Free some space or "
                                         f"choose another ssd_path.") from None
                raise StoreOpenError(f"{self.path}: cannot allocate the store's file ({e}).") from None
        if not readonly:
            try:
                env.reader_check()  # readers left by killed processes
            except lmdb.Error:
                pass
        return env

    def _lock_writable(self) -> bool:
        """Whether this user can take LMDB's reader lock (write ``lock.mdb``,
        or create it). A read-only open without it reads without registering
        as a reader: a writer in another process at the same time may reuse
        pages being read, which the blocks' checksums turn into misses."""
        lock = self.path / "lock.mdb"
        if os.access(lock if lock.exists() else self.path, os.W_OK):
            return True
        log.warning("kvstore: %s: lock.mdb is not writable by this user: reading without LMDB's reader lock "
                    "(a block a writer changes meanwhile is a miss, found by its checksum)", self.path)
        return False

    def is_full(self, e: BaseException) -> bool:
        """Whether a failed write means the device is full: ENOSPC, or the EIO
        LMDB reports for a short write, with almost no space left."""
        if is_disk_full(e):
            return True
        try:
            return isinstance(e, lmdb.Error) and shutil.disk_usage(self.path).free < _LOW_SPACE
        except OSError:
            return False

    def close(self) -> None:
        """Close this user's hold; the last one closes the environment."""
        with _SHARED_LOCK:
            self.users -= 1
            if self.users > 0:
                return
            for key in [k for k, t in _SHARED.items() if t is self]:
                del _SHARED[key]
        if self._pid != os.getpid():  # never used in this forked child: its copy of the parent's is closed
            self._env.close()
            return
        if not self.readonly:
            try:
                note_user(self, False)
            except (lmdb.Error, OSError, StorageError):
                pass  # (a full device, a store deleted under it: the next `clear` prunes this pid as dead)
        self._gate.lock_dir = None  # closing changes no map: no other process to wait for (the path may be gone)
        with self._gate.exclusive():
            self._env.close()

    # ------------------------------------------------------------ transactions

    @contextmanager
    def reader(self) -> Iterator[lmdb.Transaction]:
        """A short read transaction whose ``get`` returns mmap views."""
        for _ in range(8):
            self._gate.acquire_shared()
            try:
                txn = self.env.begin(buffers=True)
                break
            except lmdb.MapResizedError:
                self._gate.release_shared()
                self._adopt_map_size()
            except BaseException:
                self._gate.release_shared()
                raise
        else:
            raise StorageError(f"{self.path}: the map was resized repeatedly by another process")
        try:
            yield txn
        finally:
            txn.abort()
            self._gate.release_shared()

    def _adopt_map_size(self) -> None:
        """Map what another process committed past this process's map."""
        with self._gate.exclusive():
            if self.writemap:
                # the whole file: the size committed in the meta page may be less than another process
                # allocated and maps, and LMDB would truncate the file to it
                self.env.set_mapsize(max(self.env.info()["map_size"], self._file_size()))
            else:
                self.env.set_mapsize(0)  # the size the other process committed
            self._span = None  # remapped

    def _file_size(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def _grow(self, target: int) -> None:
        """A map of at least ``target`` bytes. With a writable map the file is
        allocated first, by half again (at most ``_GROW_MAX`` more; only to
        ``target`` where the device is short), unless another process already
        grew it far enough; raises ``OSError(ENOSPC)`` when the device has no
        room. With default flags the map is address space only: it doubles."""
        with self._gate.exclusive():
            cur = self.env.info()["map_size"]
            if not self.writemap:
                new = max(cur * 2, target)
            else:
                cur = max(cur, self._file_size())
                new = cur if cur >= target else \
                    allocate(self.path, max(target, cur + min(cur // 2, _GROW_MAX)), target)
            if new != self.env.info()["map_size"]:
                log.info("kvstore: growing LMDB map of %s to %d MiB", self.path, new >> 20)
                self.env.set_mapsize(new)
                self._span = None  # remapped

    def _make_room(self, nbytes: int) -> None:
        """Grow a writable map ahead of a write of about ``nbytes`` (rather than
        fail half-way with ``MapFullError`` and write it all again). Pages freed
        by evictions are not counted, so a device too full for the estimate is
        no error here: the write may still fit."""
        info = self.env.info()
        want = (info["last_pgno"] + 1) * self.env.stat()["psize"] + nbytes + nbytes // 8 + _GROW_MIN
        if want > info["map_size"]:
            try:
                self._grow(want)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise

    def write(self, fn: Callable[[lmdb.Transaction], None], nbytes: int = 0, buffers: bool = False) -> None:
        """Run ``fn`` (writing about ``nbytes``) in one write transaction; grow
        the map when full. Raises ``OSError(ENOSPC)`` when a writable map
        cannot grow for want of space."""
        if self.writemap and nbytes:
            self._make_room(nbytes)
        for _ in range(32):
            try:
                with self._gate.shared():
                    with self.env.begin(write=True, buffers=buffers) as txn:
                        fn(txn)
                return
            except lmdb.MapFullError:
                self._grow(self.env.info()["map_size"] + max(nbytes, _GROW_MIN))
            except lmdb.MapResizedError:
                self._adopt_map_size()
        raise StorageError(f"{self.path}: the LMDB map could not grow enough for one write")

    # ------------------------------------------------------------ map and meta

    def _psize(self) -> int:
        if self._page_size is None:
            self._page_size = self.env.stat()["psize"]
        return self._page_size

    def _map_span(self) -> Optional[tuple[int, int]]:
        """Where LMDB maps the data file in this process (cached; a resize
        remaps it, and clears the cache under the exclusive gate)."""
        span = self._span
        if span is None:
            span = self._span = map_base(self._data_file)
        return span

    def own_pages_only(self):
        """While the block runs, a page fault in the map reads its own page
        only (``residency.without_read_around``): for what an open reads and
        writes, and scans of the index, whose pages lie among the blocks'
        values. Not for record writes while serving: a commit's sync can take
        milliseconds, and another thread's cold read meanwhile would lose its
        read-around too."""
        return without_read_around(self._map_span())

    def get_info(self, name: str):
        """A record of the ``meta`` database (``None`` when there is none)."""
        with self.own_pages_only(), self.reader() as txn:
            raw = txn.get(name.encode(), db=self.dbs[b"meta"])
            return unpack(raw) if raw is not None else None

    def set_info(self, name: str, value) -> None:
        self.write(lambda txn: txn.put(name.encode(), pack(value), db=self.dbs[b"meta"]))

    def set_info_once(self, name: str, value):
        """Write ``meta`` record ``name`` unless there is one; returns the one
        stored (of processes racing to write it, the first wins)."""
        stored = []

        def put(txn: lmdb.Transaction) -> None:
            raw = txn.get(name.encode(), db=self.dbs[b"meta"])
            if raw is None:
                txn.put(name.encode(), pack(value), db=self.dbs[b"meta"])
            stored[:] = [value if raw is None else unpack(raw)]
        self.write(put)
        return stored[0]
