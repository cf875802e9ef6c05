"""The export file's format (docs/export-format.md): its prefix, the
frames' digests and, in a signed file (format 2), their tags; and the reader
that checks every frame before handing it on (``transfer`` writes and
imports through it)."""

from __future__ import annotations

import hmac
import os
import struct
from typing import BinaryIO, Iterator, Optional, Sequence, Union

import msgpack
import xxhash

from ..blocks.hashing import chain_key
from ..blocks.record import BlockRecord, Entry
from ..errors import TransferError
from ..tiers.remote.auth import Signer
from .catalog import check_bytes

PathLike = Union[str, os.PathLike]

MAGIC = b"\x89KVX\r\n\x1a\n"  # as PNG's: a file mangled by a text-mode copy fails here
FORMAT_VERSION = 1  # unsigned
SIGNED_VERSION = 2  # every frame carries a tag (HMAC-SHA256 under the exporter's secret) after its digest
SECRET_ENV = "KVSTORE_EXPORT_SECRET"  # where `kvstore export --sign` and `kvstore import --verify` read the secret
_DOMAIN = b"kvstore-export-v2"  # tags of export frames, never taken for another layout's under the same secret
PREFIX = struct.Struct("<8sH")  # magic, format version
MAX_FRAME = 1 << 31  # the largest frame read (a block of a large model at a large block size is ~100 MiB)


def signer_of(secret: Union[str, bytes, None]) -> Optional[Signer]:
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret:
        raise TransferError("the export secret must be a non-empty str or bytes")
    return Signer(secret, _DOMAIN)


def frame_digest(*parts) -> bytes:
    """xxh3-128 over the parts, each preceded by its length (no two splits of the same bytes agree)."""
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def tagged(kind: str, fields: Sequence) -> list:
    """What a signed frame's tag covers (``Signer.tag`` length-prefixes each part): the header's bytes, a
    block's key, record and block, the end frame's count and chain; each behind its kind, so no tag of one
    kind of frame is taken for another's."""
    if kind == "end":
        return [b"end", fields[0].to_bytes(8, "little"), fields[1]]
    return [b"header", fields[0]] if kind == "header" else list(fields[:3])


class Frames:
    """The frames of an export file, each checked before it is handed on
    (with a ``signer``: its tag too, and only a signed file is read)."""

    def __init__(self, f: BinaryIO, name: PathLike, signer: Optional[Signer] = None):
        self.name = name
        prefix = f.read(PREFIX.size)
        if len(prefix) < PREFIX.size or prefix[:8] != MAGIC:
            raise TransferError(f"{name} is not a kvstore export file (no export header): nothing was imported.")
        version = PREFIX.unpack(prefix)[1]
        if version not in (FORMAT_VERSION, SIGNED_VERSION):
            raise TransferError(f"{name} is an export file of format {version}; this kvstore reads formats "
                                f"{FORMAT_VERSION} and {SIGNED_VERSION}. Import it with the kvstore that wrote it; "
                                f"nothing was imported.")
        if signer is not None and version != SIGNED_VERSION:
            raise TransferError(f"{name} is not signed, and a signed file was asked for (a secret given): "
                                f"nothing was imported. Export it again with the secret (kvstore export --sign).")
        self.signed = version == SIGNED_VERSION
        self._signer = signer
        # frames are short arrays of bytes, ints and a tag: a length field claiming more is refused at once
        self._frames = msgpack.Unpacker(f, raw=False, use_list=True, max_buffer_size=MAX_FRAME, max_str_len=16,
                                        max_array_len=8, max_map_len=0, max_ext_len=0)
        self.chain = xxhash.xxh3_128()

    @property
    def offset(self) -> int:
        return PREFIX.size + self._frames.tell()

    def _bad(self, why: str) -> TransferError:
        return TransferError(f"{self.name} is damaged ({why}, at byte {self.offset}): nothing was imported.")

    def _fields(self, frame: list, n: int, what: str) -> list:
        """A frame's ``n`` fields (after its kind), its tag checked where a secret was given."""
        if len(frame) != 1 + n + self.signed or not all(isinstance(x, bytes) for x in frame[1 + n:]):
            raise self._bad(f"not a {what} frame")
        fields = frame[1 : 1 + n]
        if self._signer is not None:
            parts = tagged(what, fields)
            if not all(isinstance(p, bytes) for p in parts) or not hmac.compare_digest(self._signer.tag(*parts),
                                                                                        frame[-1]):
                raise TransferError(f"{self.name}: its {what} frame at byte {self.offset} is not signed under "
                                    f"this secret (a file written without it, or changed since): nothing was "
                                    f"imported.")
        return fields

    def _next(self) -> list:
        try:
            frame = next(self._frames)
        except StopIteration:
            raise TransferError(f"{self.name} is truncated (it ends at byte {self.offset} without its end "
                                f"frame): nothing was imported. Copy or export it again.") from None
        except Exception as e:  # msgpack's errors of malformed bytes
            raise self._bad(f"unreadable frame: {e}") from None
        if not isinstance(frame, list) or not frame or frame[0] not in ("header", "block", "end"):
            raise self._bad("not a frame")
        return frame

    def header(self) -> dict:
        frame = self._next()
        if frame[0] != "header" or len(frame) < 3 or not all(isinstance(x, bytes) for x in frame[1:3]) \
                or frame_digest(b"header", frame[1]) != frame[2]:
            raise self._bad("header checksum mismatch")
        raw, digest = self._fields(frame, 2, "header")
        self.chain.update(digest)
        try:
            h = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            size, models = h["block_size"], [(bytes(r), dict(i)) for r, i in h["models"]]
        except Exception:
            raise self._bad("header unreadable") from None
        if not isinstance(size, int) or size < 1:
            raise self._bad("header unreadable")
        return dict(h, block_size=size, models=models, signed=self.signed)

    def blocks(self, header: dict) -> Iterator[Entry]:
        """Every block, checked: its frame's checksum, its record, its key
        against its parent and tokens, its parent before it, its bytes
        (header bound to its key, payload checksum, tokens); then the end
        frame's count and digest chain (a frame dropped or reordered)."""
        roots = {r for r, _ in header["models"]}
        size = header["block_size"]
        ends: dict[bytes, int] = {}  # blocks so far: where each ends
        while True:
            frame = self._next()
            if frame[0] == "end":
                if len(frame) < 3 or frame[1] != len(ends) or frame[2] != self.chain.digest():
                    raise self._bad("its end frame does not match its blocks")
                self._fields(frame, 2, "end")
                if next(self._frames, None) is not None:
                    raise self._bad("bytes after the end frame")
                return
            if frame[0] != "block" or len(frame) < 5 or not all(isinstance(x, bytes) for x in frame[1:5]):
                raise self._bad("not a block frame")
            key, raw, payload, digest = frame[1:5]
            if frame_digest(key, raw, payload) != digest:
                raise self._bad(f"block {len(ends)}: checksum mismatch")
            self._fields(frame, 4, "block")
            self.chain.update(digest)
            rec = BlockRecord.unpack(key, raw)
            why = self._why(rec, key, payload, roots, ends, size)
            if why:
                raise self._bad(f"block {len(ends)}: {why}")
            ends[key] = rec.end
            yield Entry(rec, memoryview(payload))

    @staticmethod
    def _why(rec: Optional[BlockRecord], key: bytes, payload: bytes, roots: set, ends: dict, size: int):
        if rec is None:
            return "index record unreadable"
        if rec.root not in roots:
            return "of a model the header does not list"
        if rec.parent != rec.root and ends.get(rec.parent) != rec.start or rec.parent == rec.root and rec.start:
            return "its parent is not before it"
        if rec.start % size or not 0 < rec.length <= size or rec.nbytes != len(payload):
            return "its record does not fit the header's block size"
        if chain_key(rec.parent, rec.tokens) != key:
            return "its key is not its parent's and tokens'"
        return check_bytes(payload, rec)
