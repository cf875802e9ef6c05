"""What an SSD store holds, read without loading any KV: the data behind
``kvstore inspect``, ``stats``, ``verify`` and ``clear``.

An *entry* is a stored prompt: the chain of blocks from a model's root to a
leaf. Blocks shared by several entries (a common system prompt) are counted
once in totals and in each entry's own length.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import numpy as np
import xxhash

from .codec import check_key, read_header
from .errors import BlockDecodeError
from .tiers.lmdb import LmdbTier


@dataclass
class Entry:
    model: str  # model key (fingerprint) as registered
    root: str  # hex root key
    tokens: int
    blocks: int
    bytes: int
    kv: str  # codec of the leaf block ("as given", "K8/V8 g64", ...)
    dtype: str
    created: float
    last_used: float
    hits: int
    first_tokens: list[int] = field(default_factory=list)
    text: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Catalog:
    metas: dict[bytes, dict]
    models: dict[bytes, dict]
    bad: list[bytes] = field(default_factory=list)  # blocks whose index record is unreadable

    @classmethod
    def read(cls, disk: LmdbTier) -> "Catalog":
        bad: list[bytes] = []
        with disk.reader() as txn:
            metas = dict(disk.iter_meta(txn, bad))
        return cls(metas, disk.models(), bad)

    def children(self) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for k, m in self.metas.items():
            out.setdefault(m["p"], []).append(k)
        return out

    def with_descendants(self, keys) -> list[bytes]:
        """``keys`` and every block below them (unservable without them)."""
        out = set(keys)
        kids = self.children()
        stack = list(out)
        while stack:
            for c in kids.get(stack.pop(), []):
                if c not in out:
                    out.add(c)
                    stack.append(c)
        return sorted(out)

    def orphans(self) -> list[bytes]:
        """Blocks whose parent is neither a root nor a stored block."""
        return [k for k, m in self.metas.items() if m["p"] != m["r"] and m["p"] not in self.metas]

    def model_name(self, root: bytes) -> str:
        info = self.models.get(root, {})
        return info.get("name") or info.get("model_key") or root.hex()[:16]

    def entries(self, first_n: int = 16) -> Iterator[Entry]:
        kids = self.children()
        for key, meta in self.metas.items():
            if key in kids:
                continue  # not a leaf
            path = []
            k = key
            while k in self.metas:
                path.append(self.metas[k])
                k = self.metas[k]["p"]
            if k != meta["r"]:
                continue  # orphan chain
            path.reverse()
            first = np.frombuffer(path[0]["t"], dtype="<i4")[:first_n].tolist()
            yield Entry(
                model=self.model_name(meta["r"]), root=meta["r"].hex(), tokens=meta["s"] + meta["n"],
                blocks=len(path), bytes=sum(m["b"] for m in path), kv=meta.get("kv", "?"),
                dtype=meta.get("dt", "?"), created=min(m.get("c", 0) for m in path),
                last_used=max(m.get("u", 0) for m in path), hits=meta.get("h", 0), first_tokens=first)

    def per_model(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for m in self.metas.values():
            d = out.setdefault(self.model_name(m["r"]), {"blocks": 0, "bytes": 0, "tokens": 0, "hits": 0})
            d["blocks"] += 1
            d["bytes"] += m["b"]
            d["tokens"] += m["n"]
            d["hits"] += m.get("h", 0)
        return out


def check_block(disk: LmdbTier, txn, key: bytes, meta: dict) -> Optional[str]:
    """Why a stored block is bad, or ``None``: header, checksum, and tokens
    against its index meta. Reads the bytes in place; allocates no KV."""
    buf = disk.get_block(txn, key)
    if buf is None:
        return "payload missing"
    try:
        h = read_header(buf)
        check_key(h, key)
    except BlockDecodeError as e:
        return str(e)
    payload = memoryview(buf)[h.payload_start:]
    if xxhash.xxh3_64_intdigest(payload) != h.fields["sum"]:
        return "payload checksum mismatch"
    _, _, off, n = h.fields["tok"]
    if bytes(payload[off : off + n]) != bytes(meta.get("t", b"")):
        return "tokens differ from the index"
    if h.ntokens != meta.get("n"):
        return "length differs from the index"
    return None


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip().lower()
    try:
        if text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except (ValueError, IndexError):
        raise ValueError(f"cannot read {text!r} as an age: use e.g. 90s, 30m, 12h, 7d, 2w") from None


def select(cat: Catalog, model: Optional[str] = None, older_than: Optional[float] = None,
           now: Optional[float] = None) -> list[bytes]:
    """Blocks matching the filters, plus every block below them (which
    cannot be served without them)."""
    now = time.time() if now is None else now
    chosen = set()
    for k, m in cat.metas.items():
        if model is not None and not (cat.model_name(m["r"]).startswith(model) or m["r"].hex().startswith(model)):
            continue
        if older_than is not None and now - m.get("u", m.get("c", 0)) < older_than:
            continue
        chosen.add(k)
    return cat.with_descendants(chosen)
