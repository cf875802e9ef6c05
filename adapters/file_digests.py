"""Whole-file xxh3-128 digests, remembered per file identity.

A model's store key covers every byte of its weight and adapter files, and
reading an 8B model's 16 GB at every start would cost a minute (docs/benchmarks.md,
fingerprint cost). So each digest is remembered in one small JSON file
(``$KVSTORE_CACHE_DIR`` or the user cache dir, ``file-digests.json``) under
the file's identity: resolved path, device, inode, size, mtime and ctime in
ns. A file rewritten, replaced or touched has another identity and is read
again; ctime cannot be set back by a program, so a writer that restores mtime
is seen too. A digest is remembered only when the file's ctime is ``SETTLE_NS``
older than the read (timestamps are coarse: a write in the same tick as the
read could change the content and keep the identity). A missing, corrupt or
unwritable memory costs a re-read, never an error or a trusted bad entry.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence, Union

import platformdirs
import xxhash

__all__ = ["file_digests", "memory_file", "changed_since", "SETTLE_NS"]

log = logging.getLogger("kvstore")

CHUNK = 16 << 20  # bytes per read: large reads keep a disk's queue full
SETTLE_NS = 2_000_000_000  # the coarsest common timestamp granularity (FAT: 2 s)
_VERSION = 1
_HEX = re.compile(r"[0-9a-f]{32}")
_lock = threading.Lock()  # one writer of the memory file per process (processes: last replace wins)

PathLike = Union[str, os.PathLike]


def memory_file() -> Path:
    """Where digests are remembered: ``$KVSTORE_CACHE_DIR/file-digests.json``
    (tests use their own), else the user cache dir's ``kvstore`` folder."""
    root = os.environ.get("KVSTORE_CACHE_DIR") or platformdirs.user_cache_dir("kvstore")
    return Path(root) / "file-digests.json"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_whole(path: Path) -> bytes:
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # (xxhash releases the GIL: shards hash side by side)
    return h.digest()


def _load() -> dict:
    try:
        data = json.loads(memory_file().read_bytes())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == _VERSION else None
    return files if isinstance(files, dict) else {}


def _remembered(files: dict, path: str, ident: list[int]) -> Union[bytes, None]:
    entry = files.get(path)
    if isinstance(entry, dict) and entry.get("id") == ident:
        digest = entry.get("xxh3_128")
        if isinstance(digest, str) and _HEX.fullmatch(digest):
            return bytes.fromhex(digest)
    return None


def _save(new: dict) -> None:
    """Merge ``new`` into the memory file (dropping entries of files gone), atomically."""
    target = memory_file()
    with _lock:
        files = {p: e for p, e in _load().items() if os.path.exists(p)}
        files.update(new)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".file-digests.", dir=target.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": _VERSION, "files": files}, f)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:  # a read-only home: digests are read again next time
            log.debug("kvstore: cannot remember file digests in %s: %s", target, e)


def file_digests(paths: Sequence[PathLike]) -> list[bytes]:
    """The xxh3-128 digest of each file's whole content, read only where no
    digest is remembered for the file's current identity."""
    resolved = [str(Path(p).resolve()) for p in paths]
    files = _load()
    out: list[Union[bytes, None]] = []
    todo: list[int] = []
    for i, p in enumerate(resolved):
        out.append(_remembered(files, p, _identity(os.stat(p))))
        if out[-1] is None:
            todo.append(i)
    if todo:
        started = time.time_ns()
        before = {i: _identity(os.stat(resolved[i])) for i in todo}
        with ThreadPoolExecutor(min(4, len(todo))) as pool:
            for i, digest in zip(todo, pool.map(_read_whole, [Path(resolved[i]) for i in todo])):
                out[i] = digest
        new = {resolved[i]: {"id": before[i], "xxh3_128": out[i].hex()} for i in todo
               if _identity(os.stat(resolved[i])) == before[i] and before[i][4] < started - SETTLE_NS}
        if new:
            _save(new)
    return out  # type: ignore[return-value]


def settle(paths: Sequence[PathLike]) -> None:
    """Wait (at most ``SETTLE_NS``) until the files' last change is a
    timestamp granule old: a load that starts after it can tell its files
    unchanged (``changed_since``), so a model written just before a server
    loads it gets the key of its content, the one every later load gets, not
    that of the loaded weights."""
    try:
        newest = max((os.stat(p).st_ctime_ns for p in paths), default=0)
    except OSError:
        return
    wait = newest + SETTLE_NS - time.time_ns()
    if wait > 0:
        time.sleep(min(wait, SETTLE_NS) / 1e9)


def changed_since(paths: Sequence[PathLike], t_ns: int) -> bool:
    """Whether any of the files is missing or was written (or renamed,
    touched) at ``t_ns`` or later, within the timestamps' granularity."""
    try:
        return any(os.stat(p).st_ctime_ns >= t_ns - SETTLE_NS for p in paths)
    except OSError:
        return True
