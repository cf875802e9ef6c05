"""Which processes have an LMDB store open: the ``users`` record (writable
openers, kept by each as it opens and closes) and LMDB's reader table, for
``kvstore clear`` to name."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .lmdb_layout import pack, unpack

if TYPE_CHECKING:
    from .lmdb_env import LmdbEnv


def note_user(env: "LmdbEnv", opened: bool) -> None:
    """Add this process to (or remove it from) the ``users`` record: the
    processes that have the store open writable, for ``kvstore clear`` to
    name. Ids of dead processes are dropped as it goes."""
    pid = os.getpid()

    def fn(txn):
        raw = txn.get(b"users", db=env.dbs[b"meta"])
        users = [p for p in (unpack(raw) if raw is not None else []) if p != pid and _alive(p)]
        txn.put(b"users", pack(users + [pid] if opened else users), db=env.dbs[b"meta"])
    env.write(fn)


def other_processes(env: "LmdbEnv") -> list[int]:
    """Ids of the other live processes that have the store open: writable
    ones from the ``users`` record, readers from LMDB's reader table
    (where a read transaction holds a slot now)."""
    pids = set(env.get_info("users") or [])
    for line in env.env.readers().splitlines()[1:]:
        fields = line.split()
        if fields and fields[0].isdigit():
            pids.add(int(fields[0]))
    pids.discard(os.getpid())
    return sorted(p for p in pids if _alive(p))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
