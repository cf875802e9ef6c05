"""What an SSD store holds, read without loading any KV: the data behind
``kvstore inspect``, ``stats``, ``verify`` and ``clear``.

An *entry* is a stored prompt: the chain of blocks from a model's root to a
leaf. Blocks shared by several entries (a common system prompt) are counted
once in totals and in each entry's own length.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Iterator, Optional

import numpy as np
import xxhash

from ..blocks.header import check_key, read_header
from ..errors import BlockDecodeError
from ..blocks.record import BlockRecord
from ..tiers.disk.lmdb import LmdbTier


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
    differs_at: int = 0  # where this entry's tokens part from every other entry's of its model
    tail_tokens: list[int] = field(default_factory=list)  # its first tokens from there
    tail_text: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Catalog:
    records: dict[bytes, BlockRecord]
    models: dict[bytes, dict]
    bad: list[bytes] = field(default_factory=list)  # blocks whose index record is unreadable

    @classmethod
    def read(cls, disk: LmdbTier) -> "Catalog":
        bad: list[bytes] = []
        with disk.reader() as txn:
            records = {r.key: r for r in disk.records(txn, bad)}
        return cls(records, disk.models(), bad)

    def children(self) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for k, r in self.records.items():
            out.setdefault(r.parent, []).append(k)
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
        return [k for k, r in self.records.items() if r.parent != r.root and r.parent not in self.records]

    def model_name(self, root: bytes) -> str:
        """The name ``inspect`` shows (``display_names``)."""
        return self.names.get(root) or root.hex()[:16]

    @cached_property
    def names(self) -> dict[bytes, str]:
        return display_names(self.models)

    def entries(self, first_n: int = 16) -> Iterator[Entry]:
        kids = self.children()
        for key, rec in self.records.items():
            if key in kids:
                continue  # not a leaf
            path = []
            k = key
            while k in self.records:
                path.append(self.records[k])
                k = self.records[k].parent
            if k != rec.root:
                continue  # orphan chain
            path.reverse()
            at = self._differs_at(path, kids)
            tail = np.concatenate([r.tokens for r in path])[at : at + first_n] if path else np.zeros(0)
            yield Entry(
                model=self.model_name(rec.root), root=rec.root.hex(), tokens=rec.end,
                blocks=len(path), bytes=sum(r.nbytes for r in path), kv=rec.kv, dtype=rec.dtype,
                created=min(r.created for r in path), last_used=max(r.used for r in path), hits=rec.hits,
                first_tokens=path[0].tokens[:first_n].tolist(), differs_at=at, tail_tokens=tail.tolist())

    def _differs_at(self, path: list[BlockRecord], kids: dict[bytes, list[bytes]]) -> int:
        """The first token of ``path`` (root to leaf) that no other entry
        shares: the start of its first block no other entry goes through,
        plus the tokens that block has in common with its siblings."""
        for rec in path:
            siblings = [self.records[k] for k in kids.get(rec.parent, []) if k != rec.key]
            if not siblings:
                continue  # every entry through its parent goes through it
            common = 0
            for other in siblings:
                n = min(len(rec.tokens), len(other.tokens))
                diff = np.flatnonzero(rec.tokens[:n] != other.tokens[:n])
                common = max(common, int(diff[0]) if diff.size else n)
            return rec.start + common
        return 0

    def per_model(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.records.values():
            d = out.setdefault(self.model_name(r.root), {"blocks": 0, "bytes": 0, "tokens": 0, "hits": 0})
            d["blocks"] += 1
            d["bytes"] += r.nbytes
            d["tokens"] += r.length
            d["hits"] += r.hits
        return out


def display_names(models: dict[bytes, dict]) -> dict[bytes, str]:
    """Per model root, the name ``inspect`` shows and ``export --model-key``
    takes: the registered name (the model folder's), else its key's first 16
    digits; a name two roots share (one folder's content changed, two
    namespaces) gets ``@`` and the root's first 8 digits."""
    base = {r: info.get("name") or (info.get("model_key") or r.hex())[:16] for r, info in models.items()}
    counts: dict[str, int] = {}
    for name in base.values():
        counts[name] = counts.get(name, 0) + 1
    return {r: name if counts[name] == 1 else f"{name}@{r.hex()[:8]}" for r, name in base.items()}


def check_block(disk: LmdbTier, txn, rec: BlockRecord) -> Optional[str]:
    """Why a stored block is bad, or ``None``: header, checksum, and tokens
    against its index record. Reads the bytes in place; allocates no KV."""
    buf = disk.payload(txn, rec.key)
    return "payload missing" if buf is None else check_bytes(buf, rec)


def check_bytes(buf, rec: BlockRecord) -> Optional[str]:
    """Why ``buf`` is not a good block for ``rec``, or ``None``: its header
    bound to ``rec.key``, its payload checksum, its tokens those of ``rec``
    (``check_block``; ``transfer`` checks the blocks of an export file so)."""
    try:
        h = read_header(buf)
        check_key(h, rec.key)
    except BlockDecodeError as e:
        return str(e)
    payload = memoryview(buf)[h.payload_start:]
    if xxhash.xxh3_64_intdigest(payload) != h.checksum:
        return "payload checksum mismatch"
    if h.ntokens != rec.length:
        return "length differs from the index"
    tok = h.tokens
    if bytes(payload[tok.offset : tok.offset + tok.nbytes]) != rec.tokens.tobytes():
        return "tokens differ from the index"
    return None


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds (> 0: an age of 0 or less
    would select everything, which is what ``--all`` says)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip().lower()
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise ValueError(f"cannot read {text!r} as an age: use e.g. 90s, 30m, 12h, 7d, 2w") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"an age must be more than 0 (got {text!r}): use e.g. 90s, 30m, 12h, 7d, 2w, "
                         f"or --all for everything")
    return seconds


def select(cat: Catalog, model: Optional[str] = None, older_than: Optional[float] = None,
           now: Optional[float] = None) -> list[bytes]:
    """Blocks matching the filters, plus every block below them (which
    cannot be served without them)."""
    now = time.time() if now is None else now
    chosen = set()
    for k, r in cat.records.items():
        if model is not None and not (cat.model_name(r.root).startswith(model) or r.root.hex().startswith(model)):
            continue
        if older_than is not None and now - (r.used or r.created) < older_than:
            continue
        chosen.add(k)
    return cat.with_descendants(chosen)
