"""What an LMDB store directory holds, and the checks that it is one.

The directory holds LMDB's ``data.mdb`` and ``lock.mdb``; the environment
holds the sub-databases ``DBS`` (see ``tiers.lmdb`` for what each keeps) and,
in ``meta``, the format record: kvstore's name, the format version, and
whether the store is written through a writable map (every process of a store
must use the same flag). Opening checks, before anything is written, that the
directory is a kvstore store (or empty, or new), and that its format is one
this kvstore reads.

Both files get their disk blocks before LMDB maps them (``reserve_lock_file``,
``allocate``): touching a hole of a mapped file on a full device is SIGBUS,
not an error.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Optional

import lmdb
import msgpack

from ...errors import StoreOpenError
from .residency import map_base, without_read_around

FORMAT_NAME = "kvstore"
# 2: blocks carry their key (codec format 2); 3: typed index records (record.py); 4: as 3, and the
# format record says whether the store is on a writable map (a kvstore reading 3 must not write it)
FORMAT_VERSION = 4
READS = (2, 3, 4)  # 2 is read, and marked 4 (default flags) at its first writable open; 3 stays 3
DBS = (b"blocks", b"nodes", b"children", b"models", b"meta")
MAX_READERS = 512
_LOCK_BYTES = 192 + 64 * (MAX_READERS - 1)  # LMDB's lock file for that many readers (64-bit builds)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(buf) -> dict:
    return msgpack.unpackb(buf, raw=False)


def check_dir(p: Path, readonly: bool) -> None:
    """Refuse a path that is not a kvstore store, an empty directory or a new
    path (nothing written); create a new one unless ``readonly``."""
    try:
        _check_dir(p, readonly)
    except PermissionError as e:
        raise StoreOpenError(f"{p}: permission denied ({e.filename or p}). Fix the permissions "
                             f"of the directory (or its parents) or choose another ssd_path.") from None


def _check_dir(p: Path, readonly: bool) -> None:
    if p.exists() and not p.is_dir():
        raise StoreOpenError(
            f"{p} is a file, not a kvstore store directory. " + ("Check the path; nothing was written."
                                                                   if readonly else
                                                                   "Point ssd_path at a directory kvstore may own "
                                                                   "(a new path is created); nothing was written."))
    if p.is_dir():
        entries = {e.name for e in p.iterdir()}
        # a lock file alone is a store another process is creating right now (it reserves the lock
        # file before LMDB writes data.mdb): open it too
        if entries and "data.mdb" not in entries and entries != {"lock.mdb"}:
            raise StoreOpenError(
                f"{p} holds files that are not a kvstore store ({', '.join(sorted(entries)[:3])}...). "
                + ("Check the path: a store is a directory kvstore made (from an empty or new directory, opened "
                   "writable); nothing was written." if readonly else
                   "Choose an empty or new directory for ssd_path; nothing was written."))
        if "data.mdb" in entries:
            return
    if readonly:
        raise StoreOpenError(f"{p}: no kvstore store here (no data.mdb). Check the path.")
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise StoreOpenError(f"{p}: cannot create the store directory: {e.strerror}") from None


def open_dbs(env: lmdb.Environment, dbs: dict, path: Path, readonly: bool, writemap: bool,
             probe: bool = False) -> Optional[dict]:
    """Open (or, in a new store, create) the sub-databases into ``dbs`` and
    return the format record; with ``probe``, ``None`` for an empty store.
    ``writemap`` is what a new store's format record says. Closes ``env``
    before it raises ``StoreOpenError``. Its page faults read their own
    pages only (``residency.without_read_around``): not the blocks about them."""
    with without_read_around(map_base(str(path / "data.mdb"))):
        return _open_dbs(env, dbs, path, readonly, writemap, probe)


def _open_dbs(env: lmdb.Environment, dbs: dict, path: Path, readonly: bool, writemap: bool,
              probe: bool) -> Optional[dict]:
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
    except lmdb.Error as e:
        env.close()
        raise StoreOpenError(f"{path}: data.mdb is corrupt ({e}). Move it away or delete the store "
                             f"directory to start over.") from None
    if names and not set(DBS) <= set(names):
        env.close()
        raise StoreOpenError(
            f"{path} is an LMDB environment of another program (it holds "
            f"{', '.join(repr(n.decode(errors='replace')) for n in names[:4])}), not a kvstore store. "
            f"Choose another ssd_path; nothing was written.")
    if not names:
        if probe:
            return None
        if readonly:
            env.close()
            raise StoreOpenError(f"{path}: empty store.")
        # one transaction: a process killed here leaves an empty environment, not half a store
        fmt = {"name": FORMAT_NAME, "version": FORMAT_VERSION, "created": time.time(), "writemap": writemap}
        with env.begin(write=True) as txn:
            for name in DBS:
                dbs[name] = env.open_db(name, txn=txn, dupsort=(name == b"children"))
            txn.put(b"format", pack(fmt), db=dbs[b"meta"])
        return fmt
    try:
        for name in DBS:
            dbs[name] = env.open_db(name, dupsort=(name == b"children"), create=False)
        with env.begin() as txn:
            raw = txn.get(b"format", db=dbs[b"meta"])
        fmt = unpack(raw) if raw is not None else {}
    except Exception as e:
        env.close()
        raise StoreOpenError(f"{path}: kvstore metadata is unreadable ({e}). Delete the store "
                             f"directory to start over.") from None
    if fmt.get("name") != FORMAT_NAME or fmt.get("version") not in READS:
        env.close()
        raise StoreOpenError(
            f"{path} was written by kvstore format {fmt.get('name')}/{fmt.get('version')}, this "
            f"kvstore reads {FORMAT_NAME}/{FORMAT_VERSION}. Use a new ssd_path, open it with the kvstore "
            f"version that wrote it, or delete the directory {path} to start over (it is a cache); "
            f"nothing was written.")
    return fmt


def allocate(path: Path, size: int, minimum: Optional[int] = None) -> int:
    """Give ``path``'s data.mdb disk blocks up to ``size`` bytes (where the
    device has no room for that, up to ``minimum``); returns the size
    allocated. Raises ``OSError(ENOSPC)`` when neither fits, the file as it
    was. Call under the gate's exclusive side (no process maps past the old
    end, so what a failed allocation added can be cut off again)."""
    fd = os.open(path / "data.mdb", os.O_RDWR)
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
        raise OSError(errno.ENOSPC, f"No space left on device to grow {path / 'data.mdb'}")
    finally:
        os.close(fd)


def reserve_lock_file(path: Path) -> None:
    """Give LMDB's lock file real disk blocks before LMDB maps it. LMDB
    creates it sparse, and touching a hole of a mapped file on a full
    filesystem kills the process with SIGBUS; here it is a clear error."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return  # not writable here: LMDB reports what matters
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size or _LOCK_BYTES)  # holes only: size kept
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise StoreOpenError(f"{path}: no space left on its device. Free some space or choose "
                                 f"another ssd_path.") from None
    finally:
        os.close(fd)
