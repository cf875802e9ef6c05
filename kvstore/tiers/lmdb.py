"""LMDB tier: blocks and the index metadata that makes them findable, on SSD.

One environment (a directory) with sub-databases:

- ``blocks``:   block key -> serialized block (see ``codec``)
- ``nodes``:    block key -> its ``BlockRecord`` (parent, position, tokens,
                first/last use, hits, payload bytes)
- ``children``: parent key -> child keys (dupsort), to find blocks other
                processes wrote and to evict leaves only
- ``models``:   root key -> what the model is (for ``kvstore inspect``)
- ``meta``:     format name and version, lifetime counters

A block and its record commit in one transaction, so a reader never sees one
without the other, and a crash leaves either both or neither. Map size grows on
``MapFullError``; another process growing it is adopted on ``MapResizedError``.
The tier keeps the protocol of ``tiers.base``; which blocks to write or evict
is the store's decision (``persist``).

New stores are written through a writable map (LMDB's ``writemap``): a value
is copied once, into the file's pages, instead of into LMDB's buffers and then
the file (16 MiB puts ran 2.5 GB/s against 0.5-0.8). A store on a writable map
must never touch a hole of its file: on a full device that is SIGBUS, not an
error. So the file is the map, allocated with ``posix_fallocate`` before the
map covers it (at open, ahead of a batch that would not fit, on
``MapFullError``); an allocation that fails is the full-disk path. LMDB
truncates the file to the size a process maps, so no process maps less than
the file holds, and opening or changing the map happens under the gate's lock
across processes. Every process of a store must use the same flag: the format
record says which; stores made without it keep default flags.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import lmdb
import msgpack

from ..wire import Stored
from ..errors import BlockDecodeError, StorageError, StoreOpenError
from ..record import BlockRecord
from ..spread import pool
from .base import Entry, Loaded, Use, decode_into
from .gate import Gate
from .residency import (address, can_start_writeback, map_base, prefill, resident_at, start_writeback,
                        view_at)

log = logging.getLogger("kvstore")

FORMAT_NAME = "kvstore"
# 2: blocks carry their key (codec format 2); 3: typed index records (record.py); 4: as 3, and the
# format record says whether the store is on a writable map (a kvstore reading 3 must not write it)
FORMAT_VERSION = 4
_READS = (2, 3, 4)  # 2 is read, and marked 4 (default flags) at its first writable open; 3 stays 3
_DBS = (b"blocks", b"nodes", b"children", b"models", b"meta")
_MIN_MAP = 64 << 20  # default flags: the map is only address space
_NEW_MAP = 1 << 20  # a writable map's first size (its file is allocated to the map: it starts small)
_GROW_MIN = 1 << 20
_PAGE_HEADER = 16  # where LMDB puts a large value in its first overflow page (64-bit builds)
_GROW_MAX = 1 << 30  # a writable map grows by half, at most this much: the file holds what it maps
_CAN_ALLOCATE = hasattr(os, "posix_fallocate")  # without it (macOS) stores keep default flags


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(buf) -> dict:
    return msgpack.unpackb(buf, raw=False)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, lmdb.Error) and ("No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC) \
        or isinstance(e, OSError) and e.errno == errno.ENOSPC


_MAX_READERS = 512
_LOCK_BYTES = 192 + 64 * (_MAX_READERS - 1)  # LMDB's lock file for that many readers (64-bit builds)
_LOW_SPACE = 1 << 20


def _file_key(path: Path) -> Optional[tuple[int, int]]:
    """What identifies a store's data file in this process (``None``: there is none yet)."""
    try:
        st = os.stat(path / "data.mdb")
    except OSError:
        return None
    return st.st_dev, st.st_ino


_SHARED: dict[tuple[int, int], "LmdbTier"] = {}  # each store open in this process, by its data file
_SHARED_LOCK = threading.Lock()
_AFTER_FORK = threading.Lock()  # one thread of a forked child reopens a tier


def _reset_after_fork() -> None:
    global _SHARED_LOCK, _AFTER_FORK
    _SHARED_LOCK, _AFTER_FORK = threading.Lock(), threading.Lock()  # a parent's thread may have held them


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class LmdbTier:
    """One LMDB environment. ``open`` is how the store gets one: LMDB allows
    an environment once per process, so every ``PrefixStore`` of one path in
    a process shares one tier (closed with the last of them). A tier used in a
    child of ``fork()`` reopens its environment there first (LMDB's rule:
    never use an environment across ``fork()``)."""

    @classmethod
    def open(cls, path, budget_bytes: Optional[int] = None, readonly: bool = False) -> "LmdbTier":
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
        self._check_path()
        self.budget = int(budget_bytes) if budget_bytes is not None else self._default_budget()
        self.dbs = {}
        self.writemap = False
        fmt = self._open_env()
        if readonly:
            return
        try:
            if fmt["version"] == 2:
                # records of both formats are read; once this kvstore writes, an older one must not open it
                # (it would take the new records for damaged ones)
                self.set_info("format", dict(fmt, version=FORMAT_VERSION, upgraded=time.time(), writemap=False))
            self.set_info("budget", self.budget)
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
            self._init_dbs(self._env, self.dbs)
            return None
        self._gate_here.lock_dir = self.path  # other processes wait while this one opens, creates or resizes
        with self._gate_here.exclusive():
            fmt = self._stored_format()
            self.writemap = _CAN_ALLOCATE and (fmt is None or bool(fmt.get("writemap")))
            self._env = self._open(False, self.writemap)
            return self._init_dbs(self._env, self.dbs)

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

    # ------------------------------------------------------------------ open

    def _default_budget(self) -> int:
        """Half the free space where the store lives, at most 64 GiB."""
        free = shutil.disk_usage(self.path if self.path.exists() else self.path.parent).free
        return int(min(64 << 30, free // 2))

    def _check_path(self) -> None:
        try:
            self._check_dir()
        except PermissionError as e:
            raise StoreOpenError(f"{self.path}: permission denied ({e.filename or self.path}). Fix the permissions "
                                 f"of the directory (or its parents) or choose another ssd_path.") from None

    def _check_dir(self) -> None:
        p = self.path
        if p.exists() and not p.is_dir():
            raise StoreOpenError(
                f"{p} is a file, not a kvstore store directory. Point ssd_path at a directory "
                f"kvstore may own (a new path is created); nothing was written.")
        if p.is_dir():
            entries = {e.name for e in p.iterdir()}
            # a lock file alone is a store another process is creating right now (it reserves the lock
            # file before LMDB writes data.mdb): open it too
            if entries and "data.mdb" not in entries and entries != {"lock.mdb"}:
                raise StoreOpenError(
                    f"{p} holds files that are not a kvstore store ({', '.join(sorted(entries)[:3])}...). "
                    f"Choose an empty or new directory for ssd_path; nothing was written.")
            if "data.mdb" in entries:
                return
        if self.readonly:
            raise StoreOpenError(f"{p}: no kvstore store here (no data.mdb). Check the path.")
        try:
            p.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise StoreOpenError(f"{p}: cannot create the store directory: {e.strerror}") from None

    def _stored_format(self) -> Optional[dict]:
        """The format record of an existing store (``None`` for a new or empty
        one), read on a read-only open: a writable one could change the file
        (LMDB extends a writable map's file to the map) before it is checked."""
        data = self.path / "data.mdb"
        if not data.exists() or data.stat().st_size == 0:
            return None
        env = self._open(True)
        try:
            return self._init_dbs(env, {}, probe=True)
        finally:
            env.close()

    def _open(self, readonly: bool, writemap: bool = False) -> lmdb.Environment:
        data = self.path / "data.mdb"
        size = data.stat().st_size if data.exists() else 0
        if writemap:
            map_size = max(_NEW_MAP, size)  # never below the file: LMDB truncates it to the map
        else:
            map_size = max(_MIN_MAP, size, min(self.budget + self.budget // 4, 1 << 40))
        self._reserve_lock_file()
        lock = not self.readonly or self._lock_writable()
        try:
            # readahead stays on: values are multi-MiB runs read whole, and a cold fetch ran 12x
            # faster with it (0.36x vs 0.03x of a plain cold file read, docs/benchmarks.md)
            env = lmdb.open(str(self.path), map_size=map_size, subdir=True, max_dbs=len(_DBS) + 1,
                            readonly=readonly, metasync=False, readahead=True, mode=0o600,
                            max_readers=_MAX_READERS, lock=lock, writemap=writemap)
        except lmdb.Error as e:
            if isinstance(e, lmdb.ReadonlyError) or "Permission denied" in str(e):
                raise StoreOpenError(f"{self.path}: the store is not writable by this user. Open it read-only "
                                     f"(readonly=True; `kvstore inspect`, `stats` and `verify` do) or fix its "
                                     f"permissions.") from None
            if "already open in this process" in str(e):  # not through kvstore: LmdbTier.open shares its own
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
                self._allocate(env.info()["map_size"])
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

    def _allocate(self, size: int, minimum: Optional[int] = None) -> int:
        """Give data.mdb disk blocks up to ``size`` bytes (where the device has
        no room for that, up to ``minimum``); returns the size allocated.
        Raises ``OSError(ENOSPC)`` when neither fits, the file as it was.
        Call under the gate's exclusive side (no process maps past the old
        end, so what a failed allocation added can be cut off again)."""
        fd = os.open(self.path / "data.mdb", os.O_RDWR)
        try:
            old = os.fstat(fd).st_size
            for want in (size, minimum):
                if want is None:
                    continue
                try:
                    os.posix_fallocate(fd, 0, want)
                    return want
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if os.fstat(fd).st_size > old:
                        os.ftruncate(fd, old)
            raise OSError(errno.ENOSPC, f"No space left on device to grow {self.path / 'data.mdb'}")
        finally:
            os.close(fd)

    def _reserve_lock_file(self) -> None:
        """Give LMDB's lock file real disk blocks before LMDB maps it. LMDB
        creates it sparse, and touching a hole of a mapped file on a full
        filesystem kills the process with SIGBUS; here it is a clear error."""
        if not hasattr(os, "posix_fallocate"):
            return
        try:
            fd = os.open(self.path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return  # not writable here: LMDB reports what matters
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size or _LOCK_BYTES)  # holes only: size kept
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreOpenError(f"{self.path}: no space left on its device. Free some space or choose "
                                     f"another ssd_path.") from None
        finally:
            os.close(fd)

    def is_full(self, e: BaseException) -> bool:
        """Whether a failed write means the device is full: ENOSPC, or the EIO
        LMDB reports for a short write, with almost no space left."""
        if is_disk_full(e):
            return True
        try:
            return isinstance(e, lmdb.Error) and shutil.disk_usage(self.path).free < _LOW_SPACE
        except OSError:
            return False

    def _init_dbs(self, env: lmdb.Environment, dbs: dict, probe: bool = False) -> Optional[dict]:
        """Open (or, in a new store, create) the sub-databases into ``dbs`` and
        return the format record; with ``probe``, ``None`` for an empty store."""
        try:
            with env.begin() as txn:
                names = [bytes(k) for k, _ in txn.cursor()]
        except lmdb.Error as e:
            env.close()
            raise StoreOpenError(f"{self.path}: data.mdb is corrupt ({e}). Move it away or delete the store "
                                 f"directory to start over.") from None
        if names and not set(_DBS) <= set(names):
            env.close()
            raise StoreOpenError(
                f"{self.path} is an LMDB environment of another program (it holds "
                f"{', '.join(repr(n.decode(errors='replace')) for n in names[:4])}), not a kvstore store. "
                f"Choose another ssd_path; nothing was written.")
        if not names:
            if probe:
                return None
            if self.readonly:
                env.close()
                raise StoreOpenError(f"{self.path}: empty store.")
            # one transaction: a process killed here leaves an empty environment, not half a store
            fmt = {"name": FORMAT_NAME, "version": FORMAT_VERSION, "created": time.time(), "writemap": self.writemap}
            with env.begin(write=True) as txn:
                for name in _DBS:
                    dbs[name] = env.open_db(name, txn=txn, dupsort=(name == b"children"))
                txn.put(b"format", pack(fmt), db=dbs[b"meta"])
            return fmt
        try:
            for name in _DBS:
                dbs[name] = env.open_db(name, dupsort=(name == b"children"), create=False)
            with env.begin() as txn:
                raw = txn.get(b"format", db=dbs[b"meta"])
            fmt = unpack(raw) if raw is not None else {}
        except Exception as e:
            env.close()
            raise StoreOpenError(f"{self.path}: kvstore metadata is unreadable ({e}). Delete the store "
                                 f"directory to start over.") from None
        if fmt.get("name") != FORMAT_NAME or fmt.get("version") not in _READS:
            env.close()
            raise StoreOpenError(
                f"{self.path} was written by kvstore format {fmt.get('name')}/{fmt.get('version')}, this "
                f"kvstore reads {FORMAT_NAME}/{FORMAT_VERSION}. Use a new ssd_path, open it with the kvstore "
                f"version that wrote it, or delete the directory {self.path} to start over (it is a cache); "
                f"nothing was written.")
        return fmt

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
                    self._allocate(max(target, cur + min(cur // 2, _GROW_MAX)), target)
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

    # ------------------------------------------------------------ protocol

    def load(self, wanted: Sequence[tuple[bytes, int]]) -> Loaded:
        """Decoded, checked blocks, in one read transaction. Bad ones are
        reported, not removed: deleting from inside a read transaction could
        deadlock with a thread waiting to resize the map."""
        out = Loaded()
        with self.reader() as txn:
            for key, start in wanted:
                buf = self.payload(txn, key)
                if buf is None or not decode_into(out, key, start, buf):
                    break
        return out

    def store(self, entries: Iterable[Entry], nbytes: Optional[int] = None) -> None:
        """Each payload and its record in one transaction. ``entries`` may be
        a stream (the writer's blocks as it encodes them, ``nbytes`` about
        their total): each is copied into the map as it comes, so the disk
        writes the first while later ones are still being encoded, rather
        than waiting for a whole batch."""
        dbs = self.dbs
        fd = os.open(self._data_file, os.O_RDWR) if self.writemap and can_start_writeback() else -1
        source, taken = iter(entries), []

        def attempt():  # a retried transaction writes again what an earlier attempt took
            yield from list(taken)
            for e in source:
                taken.append(e)
                yield e

        def fn(txn):
            ahead = _Prefill(self, txn, fd) if fd >= 0 else None
            for e in attempt():
                n = len(e.payload)
                if ahead is not None:
                    ahead.before(n)
                txn.put(e.key, e.payload, db=dbs[b"blocks"])
                # with writemap a new value's pages are its pages in the file: its offset is final
                # (the get touches pages just written)
                offset = self.offset_of(txn.get(e.key, db=dbs[b"blocks"])) if self.writemap else -1
                if ahead is not None and offset >= 0:
                    ahead.after(offset, n)
                    start_writeback(fd, offset, n)  # the disk writes it while the next is copied
                e.record = replace(e.record, offset=offset)
                txn.put(e.key, e.record.pack(), db=dbs[b"nodes"])
                txn.put(e.record.parent, e.key, db=dbs[b"children"], dupdata=True)
        if nbytes is None:
            items = list(source)
            source, nbytes = iter(items), sum(len(e.payload) for e in items)
        try:
            self.write(fn, nbytes, buffers=True)
        finally:
            if fd >= 0:
                os.close(fd)

    def _free_and_end(self, txn: lmdb.Transaction) -> tuple[int, int]:
        """Bytes of the file's free pages and where LMDB's last page in use
        ends, as of the transaction's start."""
        info, psize = self.env.info(), self._psize()
        end = (info["last_pgno"] + 1) * psize
        used = 2 * psize + _pages(self.env.stat()) + sum(_pages(txn.stat(db)) for db in self.dbs.values())
        return end - used, end

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Remove blocks and their records; returns the keys that were there."""
        done: list[bytes] = []
        dbs = self.dbs

        def fn(txn):
            done.clear()
            for key in keys:
                raw = txn.get(key, db=dbs[b"nodes"])
                if raw is None and txn.get(key, db=dbs[b"blocks"]) is None:
                    continue
                rec = None if raw is None else BlockRecord.unpack(key, raw)
                txn.delete(key, db=dbs[b"blocks"])
                txn.delete(key, db=dbs[b"nodes"])
                txn.delete(key, db=dbs[b"children"])
                if rec is not None:
                    txn.delete(rec.parent, key, db=dbs[b"children"])
                done.append(key)
        self.write(fn)
        return done

    def touch(self, uses: Mapping[bytes, Use]) -> None:
        """Record last-use times and hit counts."""
        nodes = self.dbs[b"nodes"]

        def fn(txn):
            for key, use in uses.items():
                raw = txn.get(key, db=nodes)
                rec = None if raw is None else BlockRecord.unpack(key, raw)
                if rec is not None:
                    txn.put(key, rec.used_now(use.when, use.hits).pack(), db=nodes)
        if uses:
            self.write(fn)

    def usage(self) -> int:
        """Bytes in use by every database, from LMDB's own page counts."""
        with self.reader() as txn:
            total = _pages(self.env.stat())
            for db in self.dbs.values():
                total += _pages(txn.stat(db))
        return total

    # ------------------------------------------------------------------ reads

    def payload(self, txn: lmdb.Transaction, key: bytes):
        """A block's bytes: a view of the map, valid inside ``txn`` only."""
        return txn.get(key, db=self.dbs[b"blocks"])

    def stored(self, txn: lmdb.Transaction, key: bytes, start: int, unread: bool = False
               ) -> Union[Stored, str, None]:
        """A block's bytes with its header checked and bound to ``key`` (its
        payload is not checked yet: ``Stored.intact``), the reason it is bad,
        or ``None`` when absent. Valid inside ``txn`` only.

        ``unread``: without reading the payload yet. py-lmdb's ``get`` reads
        every page of a value before it returns, so a cold hit read all its
        blocks before the first was copied; here the view is taken where the
        block's record (written in the same transaction as the value) says
        its bytes lie, and its pages are read as they are copied, while the
        next ones are still on their way. Where the record has no offset, or
        the bytes there are not this block's, the value is read as above.
        kvstore writes a value and its record in one transaction, and LMDB
        never moves a large value it does not rewrite; a value rewritten
        through LMDB by another program, its record left as it was, is read
        from its old pages (its key and checksum still decide: a page reused
        meanwhile fails the checksum and the block is dropped, never served)."""
        if unread:
            got = self._stored_unread(txn, key, start)
            if got is not None:
                return got
        buf = self.payload(txn, key)
        if buf is None:
            return None
        try:
            return Stored.of(buf, key, start)
        except BlockDecodeError as e:
            return str(e)

    def _stored_unread(self, txn: lmdb.Transaction, key: bytes, start: int) -> Optional[Stored]:
        span = self._map_span()
        rec = self.record(txn, key) if span is not None else None
        if rec is None or rec.offset < 0 or rec.offset + rec.nbytes > min(span[1] - span[0], self._file_size()):
            return None  # (past the file's end a mapped page is a SIGBUS, not an error)
        psize = self._psize()
        if rec.nbytes < psize or rec.offset % psize != _PAGE_HEADER:
            # only a value on pages of its own (LMDB's overflow pages, 16 bytes into the first) stays where it
            # was written; a small one lives in a leaf page that later writes copy elsewhere
            return None
        try:
            return Stored.of(view_at(span[0] + rec.offset, rec.nbytes), key, start)
        except BlockDecodeError:
            return None  # not this block's bytes (a store copied elsewhere): LMDB knows where they are

    def _psize(self) -> int:
        if self._page_size is None:
            self._page_size = self.env.stat()["psize"]
        return self._page_size

    def record(self, txn: lmdb.Transaction, key: bytes) -> Optional[BlockRecord]:
        """The block's index record; ``None`` when missing or malformed."""
        raw = txn.get(key, db=self.dbs[b"nodes"])
        return None if raw is None else BlockRecord.unpack(key, raw)

    def children(self, txn: lmdb.Transaction, key: bytes) -> list[bytes]:
        cur = txn.cursor(db=self.dbs[b"children"])
        if not cur.set_key(key):
            return []
        return [bytes(k) for k in cur.iternext_dup()]

    def _map_span(self) -> Optional[tuple[int, int]]:
        """Where LMDB maps the data file in this process (cached; a resize
        remaps it, and clears the cache under the exclusive gate)."""
        span = self._span
        if span is None:
            span = self._span = map_base(self._data_file)
        return span

    def offset_of(self, buf) -> int:
        """A value's offset in the file from a view of it (-1 when not in the map)."""
        span = self._map_span()
        addr = address(buf)
        return addr - span[0] if span is not None and span[0] <= addr < span[1] else -1

    def read_ahead(self, keys: Sequence[bytes]) -> list[Future]:
        """Start bringing values into the page cache, in order, from worker
        threads; returns their futures. py-lmdb's ``get`` touches every page
        of the value it returns, with the GIL released: one ``get`` per thread
        is one sequential read, so a cold hit is read by several streams, and
        the caller copies the first blocks while later ones are read (a page
        it reaches first waits for the read under way)."""
        blocks = self.dbs[b"blocks"]

        def one(key: bytes) -> None:
            with self.reader() as txn:
                txn.get(key, db=blocks)

        # threads of its own: a worker waiting here for a resize must never hold up a hit's gather
        # (on the shared pool) that holds the reader the resize waits for
        ahead = pool("readahead")
        return [ahead.submit(one, k) for k in keys]

    def resident(self, spans: Mapping[bytes, tuple[int, int]]) -> dict[bytes, Optional[float]]:
        """Per block (by its ``(offset, nbytes)`` in the file, from its record),
        the fraction of its pages in the page cache, ``None`` where that cannot
        be told: a page-cached read and a cold one differ several-fold, and
        the cost model needs to know which it faces. Reads nothing."""
        out: dict[bytes, Optional[float]] = {k: None for k in spans}
        with self._gate.shared():  # no remap meanwhile
            base = self._map_span() if any(off >= 0 for off, _ in spans.values()) else None
            if base is None:
                return out
            for key, (off, n) in spans.items():
                if off >= 0 and base[0] + off + n <= base[1]:
                    out[key] = resident_at(base[0] + off, n)
        return out

    def records(self, txn: lmdb.Transaction, bad: Optional[list] = None) -> Iterator[BlockRecord]:
        """Every well-formed index record; keys of malformed ones go to ``bad``."""
        for k, v in txn.cursor(db=self.dbs[b"nodes"]):
            rec = BlockRecord.unpack(bytes(k), v)
            if rec is None:
                if bad is not None:
                    bad.append(bytes(k))
                continue
            yield rec

    def models(self) -> dict[bytes, dict]:
        with self.reader() as txn:
            return {bytes(k): unpack(v) for k, v in txn.cursor(db=self.dbs[b"models"])}

    def get_counters(self) -> dict:
        return self.get_info("counters") or {}

    def get_info(self, name: str):
        with self.reader() as txn:
            raw = txn.get(name.encode(), db=self.dbs[b"meta"])
            return unpack(raw) if raw is not None else None

    def set_info(self, name: str, value) -> None:
        self.write(lambda txn: txn.put(name.encode(), pack(value), db=self.dbs[b"meta"]))

    # ----------------------------------------------------------------- writes

    def register_model(self, root: bytes, info: dict) -> None:
        def fn(txn):
            if txn.get(root, db=self.dbs[b"models"]) is None:
                txn.put(root, pack(info), db=self.dbs[b"models"])
        self.write(fn)

    def add_counters(self, counters: Mapping[str, int]) -> None:
        """Add to the store's lifetime counters."""
        def fn(txn):
            raw = txn.get(b"counters", db=self.dbs[b"meta"])
            total = unpack(raw) if raw is not None else {}
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
            txn.put(b"counters", pack(total), db=self.dbs[b"meta"])
        if counters:
            self.write(fn)

    def remove_all(self, root: Optional[bytes] = None) -> int:
        """Delete every block (of one root key, if given). Returns how many."""
        bad: list[bytes] = []
        with self.reader() as txn:
            keys = [r.key for r in self.records(txn, bad) if root is None or r.root == root]
        return len(self.remove(keys + (bad if root is None else [])))


def _pages(stat: dict) -> int:
    return stat["psize"] * (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"])


class _Prefill:
    """Puts in place the page cache of the pages each value of a write will
    take, just before it is copied, where that is known: when the file's free
    pages could not hold it, LMDB takes new pages past the last one in use
    (which hold nothing: zeros are written there, ``residency.prefill``).
    Where they could (after evictions), LMDB may reuse those instead: left
    alone then. Value by value rather than a whole batch first, so the first
    copy, and the disk's first write, do not wait for the rest."""

    _SLACK = 1 << 20  # past a value: the few leaf and branch pages a put takes besides

    def __init__(self, tier: LmdbTier, txn: lmdb.Transaction, fd: int):
        self.fd = fd
        self.free, self.at = tier._free_and_end(txn)  # at: where the next appended value starts (about)
        self.done = self.at  # prefilled up to here
        self.psize = tier._psize()
        # never past the map or the file (a write there would grow the file): neither changes during the
        # transaction, since a resize waits for it on the gate
        self.limit = min(tier.env.info()["map_size"], tier._file_size())

    def before(self, n: int) -> None:
        if self.free >= n:
            self.free -= n  # (it may take free pages: counted as taken)
            return
        stop = min(self.at + n + self.psize + self._SLACK, self.limit)
        if stop > self.done:
            prefill(self.fd, self.done, stop - self.done)
            self.done = stop

    def after(self, offset: int, n: int) -> None:
        """A value now lies at ``[offset, offset + n)``: nothing at or before
        its end, nor the few pages LMDB takes right after it, is zeroed later
        (a value that went where no prefill was, appended after all, moves
        the prefilled end past it)."""
        self.at = max(self.at, offset + n)
        self.done = max(self.done, self.at + self._SLACK)
