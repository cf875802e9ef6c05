"""The index record of one stored block: what makes it findable without
reading its payload.

One typed record, written by the store, kept by the LMDB tier (and any other
persistent tier) beside the block's bytes, read back to rebuild the index at
open and by the catalog behind ``kvstore inspect``. Packed as a msgpack map
with named fields and a version; records of format 2 stores (a map of
single-letter keys, kvstore 0.1 before the record) are read too.

A record that does not parse into well-typed fields is ``None``: torn or
flipped bytes make a block absent, never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import msgpack
import numpy as np

RECORD_VERSION = 1

# token ids are int32 where every id fits, int64 otherwise (width in bytes)
_TOKEN_DTYPES = {4: np.dtype("<i4"), 8: np.dtype("<i8")}


@dataclass(frozen=True)
class BlockRecord:
    """A block at tokens ``[start, start + length)`` of the prompts below ``parent``.

    ``snap``, ``gap`` and ``rows_from`` say which layers it can restore (see
    ``index.Node``); ``first`` is its first token (partial matches compare
    only blocks starting with the prompt's token); ``nbytes`` is the payload's
    size; ``kv``/``dtype`` describe its codec for people.
    """

    key: bytes
    parent: bytes
    root: bytes
    start: int
    length: int
    tokens: np.ndarray
    nbytes: int
    first: int = -1
    snap: Optional[bool] = None
    gap: int = 0
    rows_from: int = -1  # -1: ``start`` (every row there)
    created: float = 0.0
    used: float = 0.0
    hits: int = 0
    kv: str = "?"
    dtype: str = "?"
    offset: int = -1  # where the value's bytes sit in the LMDB file (-1: unknown); for residency checks only

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def first_row(self) -> int:
        return self.start if self.rows_from < 0 else self.rows_from

    def used_now(self, when: float, hits: int) -> "BlockRecord":
        return replace(self, used=max(self.used, when), hits=self.hits + hits)

    def pack(self) -> bytes:
        toks = np.ascontiguousarray(self.tokens)
        return msgpack.packb({
            "v": RECORD_VERSION, "parent": self.parent, "root": self.root, "start": self.start,
            "length": self.length, "tokens": toks.tobytes(), "token_bytes": toks.dtype.itemsize,
            "nbytes": self.nbytes, "first": self.first, "snap": self.snap, "gap": self.gap,
            "rows_from": self.rows_from, "created": self.created, "used": self.used, "hits": self.hits,
            "kv": self.kv, "dtype": self.dtype, "offset": self.offset}, use_bin_type=True)

    @classmethod
    def unpack(cls, key: bytes, raw) -> Optional["BlockRecord"]:
        """The record stored under ``key``, or ``None`` when malformed."""
        try:
            m = msgpack.unpackb(raw, raw=False)
        except Exception:
            return None
        if not isinstance(m, dict):
            return None
        if "v" not in m and "p" in m:
            m = _from_format2(m)
        elif m.get("v") != RECORD_VERSION:
            return None
        for name, types in _TYPES.items():
            if name in m and (not isinstance(m[name], types) or (bool not in types and isinstance(m[name], bool))):
                return None
        if any(name not in m for name in _REQUIRED):
            return None
        dt = _TOKEN_DTYPES.get(m.get("token_bytes", 4))
        if dt is None or m["start"] < 0 or m["length"] < 0 or len(m["tokens"]) != dt.itemsize * m["length"]:
            return None
        return cls(key=bytes(key), parent=m["parent"], root=m["root"], start=m["start"], length=m["length"],
                   tokens=np.frombuffer(m["tokens"], dtype=dt), nbytes=m["nbytes"], first=m.get("first", -1),
                   snap=m.get("snap"), gap=m.get("gap", 0), rows_from=m.get("rows_from", -1),
                   created=m.get("created", 0.0), used=m.get("used", 0.0), hits=m.get("hits", 0),
                   kv=m.get("kv", "?"), dtype=m.get("dtype", "?"), offset=m.get("offset", -1))


@dataclass(frozen=True)
class Entry:
    """A block to keep: its record and its bytes, as every tier stores them
    (made once, by the writer; a remote read brings them as they are)."""

    record: BlockRecord
    payload: memoryview

    @property
    def key(self) -> bytes:
        return self.record.key


@dataclass(frozen=True)
class Use:
    """Blocks served: the last time, and how many times since the last save."""

    when: float
    hits: int = 1


_NUM = (int, float)
_TYPES = {"parent": (bytes,), "root": (bytes,), "start": (int,), "length": (int,), "tokens": (bytes,),
          "token_bytes": (int,), "nbytes": (int,), "first": (int,), "snap": (bool, type(None)), "gap": (int,),
          "rows_from": (int,), "created": _NUM, "used": _NUM, "hits": (int,), "kv": (str,), "dtype": (str,),
          "offset": (int,)}
_REQUIRED = ("parent", "root", "start", "length", "tokens", "nbytes")

# format 2 (kvstore 0.1): single-letter keys; "wf" absent meant "rows from the start", or, with a gap, none
_FORMAT2 = {"p": "parent", "r": "root", "s": "start", "n": "length", "t": "tokens", "b": "nbytes", "f": "first",
            "sn": "snap", "g": "gap", "wf": "rows_from", "c": "created", "u": "used", "h": "hits", "kv": "kv",
            "dt": "dtype"}


def _from_format2(m: dict) -> dict:
    out = {_FORMAT2[k]: v for k, v in m.items() if k in _FORMAT2}
    if "rows_from" not in out and out.get("gap", 0) > 0 and isinstance(out.get("start"), int) \
            and isinstance(out.get("length"), int):
        out["rows_from"] = out["start"] + out["length"]
    return out
