"""Carrying a store's entries to another machine: ``kvstore export`` and
``kvstore import`` (``export_store``, ``import_store``).

An export file is a fixed prefix (magic, format version) and a stream of
msgpack frames: a header (block size, the models it holds), one frame per
block (its key, index record and serialized block, with an xxh3-128 over the
three), and an end frame (the block count and a chain of every frame's
digest). docs/export-format.md describes it. Both sides stream: memory is
one write batch and a few dozen bytes per block (its key), whatever the
store's size.

Import checks the whole file in a first pass and writes in a second. A
stage-and-commit import (write each verified block whose parent is there)
would leave half a file's blocks behind when a byte flips near its end; the
two passes make the outcome whole: a damaged, truncated or foreign file
imports nothing. The second pass checks every block again as it writes it
(the file may have changed between the passes): a block that fails then is
not written, and the import stops. Writes go through the tier's own commit
(``LmdbTier.store``: a block and its record in one transaction, only with
its parent on disk, a block already there left as it is), so engines that
have the store open find the blocks as they find any other process's, at
their next lookup that reaches them.

The checks catch damage, not forgery: whoever can write the file can write
KV that is consistent and wrong. A signed export (``secret=``: format 2)
carries an HMAC-SHA256 tag under the exporter's secret on every frame, and
an import given the secret takes only files whose every tag it verifies, in
both passes (each block's own tag is checked again as it is written): a
file only a keyholder could have written.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional, Union

import hmac

import msgpack
import xxhash

from .. import __version__
from .catalog import check_bytes
from ..errors import StoreOpenError, TransferError
from ..blocks.hashing import chain_key, root_key
from ..blocks.record import BlockRecord, Entry
from ..tiers.disk.lmdb import LmdbTier
from ..tiers.remote.auth import Signer

MAGIC = b"\x89KVX\r\n\x1a\n"  # as PNG's: a file mangled by a text-mode copy fails here
FORMAT_VERSION = 1  # unsigned
SIGNED_VERSION = 2  # every frame carries a tag (HMAC-SHA256 under the exporter's secret) after its digest
SECRET_ENV = "KVSTORE_EXPORT_SECRET"  # where `kvstore export --sign` and `kvstore import --verify` read the secret
_DOMAIN = b"kvstore-export-v2"  # tags of export frames, never taken for another layout's under the same secret
PREFIX = struct.Struct("<8sH")  # magic, format version
_MAX_FRAME = 1 << 31  # the largest frame read (a block of a large model at a large block size is ~100 MiB)
_BATCH_BYTES = 64 << 20  # block bytes per write transaction of an import
_READ_BATCH = 256  # blocks per read transaction of an export

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
PathLike = Union[str, os.PathLike]


@dataclass
class Report:
    """What an export or import did."""

    blocks: int = 0  # blocks written to the file / into the store
    nbytes: int = 0  # their serialized bytes
    present: int = 0  # import: blocks the store held already (left as they were)
    skipped: int = 0  # export: damaged blocks, or removed meanwhile, and the blocks below them; import: blocks
    #                   whose parent a `kvstore clear` removed while the import ran
    models: list[str] = field(default_factory=list)
    block_size: int = 0
    signed: bool = False  # the file carries tags (format 2)
    verified: bool = False  # ... and every one was checked under the secret given


# ------------------------------------------------------------------ export


def _signer(secret: Union[str, bytes, None]) -> Optional[Signer]:
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret:
        raise TransferError("the export secret must be a non-empty str or bytes")
    return Signer(secret, _DOMAIN)


def export_store(ssd_path: PathLike, file: PathLike, model_key: Optional[str] = None,
                 namespace: Optional[str] = None, progress: Optional[Progress] = None,
                 secret: Union[str, bytes, None] = None) -> Report:
    """Write the entries of the store at ``ssd_path`` (of ``model_key`` and / or
    ``namespace`` only, when given) to ``file``, replaced whole once it is
    complete; with ``secret``, signed (format 2: every frame tagged). Opens
    the store read-only: safe beside engines writing it. Every block is
    checked as it is read; a damaged one is left out with the blocks below
    it (``Report.skipped``)."""
    signer = _signer(secret)
    tier = LmdbTier.open(ssd_path, readonly=True)
    try:
        size = _block_size(tier)
        models = tier.models()
        roots = _roots(models, model_key, namespace)
        with tier.reader() as txn:
            order = sorted((r.start, r.key, r.nbytes, r.root) for r in tier.records(txn)
                           if roots is None or r.root in roots)
        header = {"kvstore": __version__, "created": time.time(), "block_size": size,
                  "models": [[r, models.get(r, {})] for r in sorted({o[3] for o in order})],
                  "filter": {"model_key": model_key, "namespace": namespace}}
        tmp = Path(f"{file}.partial")
        try:
            with _opened(tmp, "wb", shown=file) as f:
                report = _write(tier, f, header, order, progress, signer)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, file)
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        tier.close()
    report.models = [_name(info, r) for r, info in header["models"]]
    report.block_size = size
    report.signed = report.verified = signer is not None
    return report


def _roots(models: dict[bytes, dict], model_key: Optional[str], namespace: Optional[str]) -> Optional[set[bytes]]:
    """Root keys the filters select (``None``: no filter, every root): models
    registered under that key and / or namespace, and the root they hash to."""
    if model_key is None and namespace is None:
        return None
    out = {r for r, info in models.items()
           if (model_key is None or info.get("model_key") == model_key)
           and (namespace is None or info.get("namespace") == namespace)}
    if model_key is not None:
        out.add(root_key(model_key, namespace))
    return out


def _write(tier: LmdbTier, f: BinaryIO, header: dict, order: list, progress: Optional[Progress],
           signer: Optional[Signer]) -> Report:
    report = Report()
    total = sum(o[2] for o in order)
    tags = (lambda *parts: [signer.tag(*parts)]) if signer is not None else (lambda *parts: [])
    f.write(PREFIX.pack(MAGIC, FORMAT_VERSION if signer is None else SIGNED_VERSION))
    raw = msgpack.packb(header, use_bin_type=True)
    digest = _digest(b"header", raw)
    chain = xxhash.xxh3_128(digest)
    f.write(msgpack.packb(["header", raw, digest, *tags(b"header", raw)], use_bin_type=True))
    roots = {r for r, _ in header["models"]}
    done: set[bytes] = set()
    for i in range(0, len(order), _READ_BATCH):  # short read transactions: engines' writes reuse freed pages
        with tier.reader() as txn:
            for _, key, _, _ in order[i : i + _READ_BATCH]:
                rec = tier.record(txn, key)
                buf = None if rec is None else tier.payload(txn, key)
                if buf is None or rec.root not in roots or (rec.parent != rec.root and rec.parent not in done) \
                        or check_bytes(buf, rec) is not None:
                    report.skipped += 1  # (removed meanwhile, damaged, or below such a block)
                    continue
                rec_raw = replace(rec, offset=-1).pack()
                digest = _digest(key, rec_raw, buf)
                chain.update(digest)
                f.write(msgpack.packb(["block", key, rec_raw, buf, digest, *tags(key, rec_raw, buf)],
                                      use_bin_type=True))
                done.add(key)
                report.blocks += 1
                report.nbytes += len(buf)
                if progress is not None:
                    progress(report.nbytes, total)
    end = chain.digest()
    f.write(msgpack.packb(["end", report.blocks, end, *tags(b"end", report.blocks.to_bytes(8, "little"), end)],
                          use_bin_type=True))
    return report


def _digest(*parts) -> bytes:
    """xxh3-128 over the parts, each preceded by its length (no two splits of the same bytes agree)."""
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


# ------------------------------------------------------------------ import


def import_store(ssd_path: PathLike, file: PathLike, progress: Optional[Progress] = None,
                 secret: Union[str, bytes, None] = None) -> Report:
    """Add the entries of export file ``file`` to the store at ``ssd_path``
    (made when the path is new or an empty directory). Raises
    ``TransferError`` for a file that is not an export file, of another
    format version, truncated, damaged, or of another block size than the
    store, and, with ``secret``, for a file not signed under it: then nothing
    was written. Safe beside engines that have the store open (see the
    module docstring)."""
    signer = _signer(secret)
    total = _file_size(file)
    header = _check(file, lambda n: progress(n, 2 * total) if progress else None, signer)
    path = Path(ssd_path).expanduser()
    tier = LmdbTier.open(path, _stored_budget(path))
    try:
        size = header["block_size"]
        if tier.get_info("layout") is None and _has_blocks(tier):
            raise TransferError(f"{path} records no block size (a store of an older kvstore): open it once with an "
                                f"engine (PrefixStore(ssd_path=...)), then import; nothing was written.")
        have = tier.set_info_once("layout", {"block_size": size}).get("block_size")
        if have != size:
            raise TransferError(f"{file} holds blocks of {size} tokens, the store at {path} blocks of {have}: "
                                f"a block's key hashes its tokens, so they would never be found there. Import "
                                f"into a store of {size}-token blocks (a new path makes one); nothing was written.")
        report = Report(block_size=size, signed=header["signed"], verified=signer is not None)
        for root, info in header["models"]:
            if info:
                tier.register_model(root, info)
            report.models.append(_name(info, root))
        batch: list[Entry] = []
        held = 0
        with open(file, "rb") as f:
            frames = _Frames(f, file, signer)
            try:
                for entry in frames.blocks(frames.header()):
                    batch.append(entry)
                    held += len(entry.payload)
                    if held >= _BATCH_BYTES:
                        _commit(tier, batch, report)
                        held = 0
                    if progress is not None:
                        progress(total + frames.offset, 2 * total)
            except TransferError as e:
                raise TransferError(f"{file} changed while it was imported ({e}); the {report.blocks} blocks "
                                    f"written before, each checked, are in the store.") from None
            _commit(tier, batch, report)
            if progress is not None:
                progress(2 * total, 2 * total)
    finally:
        tier.close()
    return report


def _check(file: PathLike, progress: Callable[[int], None], signer: Optional[Signer]) -> dict:
    """The header of ``file`` once every frame of it checked out (``TransferError`` otherwise)."""
    with _opened(file, "rb") as f:
        frames = _Frames(f, file, signer)
        header = frames.header()
        for _ in frames.blocks(header):
            progress(frames.offset)
    return header


def _commit(tier: LmdbTier, batch: list[Entry], report: Report) -> None:
    if not batch:
        return
    written = tier.store(batch, sum(len(e.payload) for e in batch), skip_present=True)
    report.blocks += len(written.records)
    report.nbytes += sum(r.nbytes for r in written.records)
    report.present += len(written.present)
    report.skipped += len(written.parentless)
    batch.clear()


class _Frames:
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
        self._frames = msgpack.Unpacker(f, raw=False, use_list=True, max_buffer_size=_MAX_FRAME, max_str_len=16,
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
            parts = [b"end", fields[0].to_bytes(8, "little"), fields[1]] if what == "end" else \
                [b"header", fields[0]] if what == "header" else fields[:3]
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
                or _digest(b"header", frame[1]) != frame[2]:
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
            if _digest(key, raw, payload) != digest:
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


# ----------------------------------------------------------------- helpers


def _block_size(tier: LmdbTier) -> int:
    layout = tier.get_info("layout")
    size = layout.get("block_size") if isinstance(layout, dict) else None
    if not isinstance(size, int) or size < 1:
        raise StoreOpenError(f"{tier.path} records no block size (a store of an older kvstore): open it once "
                             f"writable with this kvstore (PrefixStore(ssd_path=...)) and export again.")
    return size


def _has_blocks(tier: LmdbTier) -> bool:
    with tier.reader() as txn:
        return next(iter(tier.records(txn)), None) is not None


def _stored_budget(path: Path) -> Optional[int]:
    """The disk budget the store's engines set (an import keeps it), ``None`` for a new store."""
    if not (path / "data.mdb").is_file():
        return None
    tier = LmdbTier.open(path, readonly=True)
    try:
        budget = tier.get_info("budget")
    finally:
        tier.close()
    return budget if isinstance(budget, int) and budget > 0 else None


def _file_size(file: PathLike) -> int:
    try:
        return os.stat(file).st_size
    except OSError as e:
        raise TransferError(f"{file}: cannot read it ({e.strerror}).") from None


def _opened(file: PathLike, mode: str, shown: Optional[PathLike] = None) -> BinaryIO:
    try:
        return open(file, mode)
    except OSError as e:
        raise TransferError(f"{shown or file}: cannot {'read' if 'r' in mode else 'write'} it ({e.strerror}).") from None


def _name(info: dict, root: bytes) -> str:
    return info.get("name") or info.get("model_key") or root.hex()[:16]
