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
their next lookup that reaches them. An import that takes the store past its
disk budget then evicts least recently used leaves, as an engine would.

The checks catch damage, not forgery: whoever can write the file can write
KV that is consistent and wrong. A signed export (``secret=``: format 2)
carries an HMAC-SHA256 tag under the exporter's secret on every frame, and
an import given the secret takes only files whose every tag it verifies, in
both passes (each block's own tag is checked again as it is written): a
file only a keyholder could have written.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Union

import lmdb
import msgpack
import xxhash

from .. import __version__
from ..blocks.hashing import root_key
from ..blocks.record import Entry
from ..config import store_config
from ..counters import Counters
from ..errors import StorageError, StoreOpenError, TransferError
from ..flow.disk import Disk
from ..state.table import BlockTable
from ..tiers.disk.lmdb import LmdbTier
from ..tiers.disk.lmdb_env import is_disk_full
from ..tiers.remote.auth import Signer
from .catalog import check_bytes, display_names
from .export_file import FORMAT_VERSION, MAGIC, PREFIX, SIGNED_VERSION, Frames, frame_digest, signer_of, tagged

_BATCH_BYTES = 64 << 20  # block bytes per write transaction of an import
_READ_BATCH = 256  # blocks per read transaction of an export

log = logging.getLogger("kvstore")
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
    evicted: int = 0  # import: least recently used blocks deleted to bring the store under its disk budget
    signed: bool = False  # the file carries tags (format 2)
    verified: bool = False  # import: ... and every tag was checked under the secret given


# ------------------------------------------------------------------ export


def export_store(ssd_path: PathLike, file: PathLike, model_key: Optional[str] = None,
                 namespace: Optional[str] = None, progress: Optional[Progress] = None,
                 secret: Union[str, bytes, None] = None) -> Report:
    """Write the entries of the store at ``ssd_path`` (of ``model_key`` and / or
    ``namespace`` only, when given) to ``file``, replaced whole once it is
    complete; with ``secret``, signed (format 2: every frame tagged). Opens
    the store read-only: safe beside engines writing it. Every block is
    checked as it is read; a damaged one is left out with the blocks below
    it (``Report.skipped``)."""
    signer = signer_of(secret)
    if Path(file).is_dir():
        raise TransferError(f"{file} is a directory: name the export file to write in it (e.g. "
                            f"{Path(file, 'cache.kvx')}); nothing was written.")
    tier = LmdbTier.open(ssd_path, readonly=True)
    try:
        size = _block_size(tier)
        models = tier.models()
        roots = _roots(models, model_key, namespace)
        with tier.reader() as txn:
            order = sorted((r.start, r.key, r.nbytes, r.root) for r in tier.records(txn)
                           if roots is None or r.root in roots)
        if model_key is not None and not order:
            names = ", ".join(sorted(display_names(models).values())) or "none"
            raise TransferError(f"{ssd_path}: no model {model_key!r} stored (`kvstore inspect` names the "
                                f"models it holds: {names}).")
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
        except OSError as e:  # (a full device, a folder made at that name meanwhile)
            raise TransferError(f"{file}: cannot write it ({e.strerror}); nothing was written.") from None
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        tier.close()
    shown = display_names(models)
    report.models = [shown.get(r, r.hex()[:16]) for r, _ in header["models"]]
    report.block_size = size
    report.signed = signer is not None
    return report


def _roots(models: dict[bytes, dict], model_key: Optional[str], namespace: Optional[str]) -> Optional[set[bytes]]:
    """Root keys the filters select (``None``: no filter, every root): models
    registered under that key or name (``inspect``'s, or the folder's: every
    root of that name) and / or namespace, and the root the key hashes to."""
    if model_key is None and namespace is None:
        return None
    shown = display_names(models)
    out = {r for r, info in models.items()
           if (model_key is None or model_key in (info.get("model_key"), info.get("name"), shown[r]))
           and (namespace is None or info.get("namespace") == namespace)}
    if model_key is not None:
        out.add(root_key(model_key, namespace))
    return out


def _write(tier: LmdbTier, f: BinaryIO, header: dict, order: list, progress: Optional[Progress],
           signer: Optional[Signer]) -> Report:
    report = Report()
    total = sum(o[2] for o in order)
    tags = (lambda kind, *fields: [signer.tag(*tagged(kind, fields))]) if signer is not None else \
        (lambda kind, *fields: [])
    f.write(PREFIX.pack(MAGIC, FORMAT_VERSION if signer is None else SIGNED_VERSION))
    raw = msgpack.packb(header, use_bin_type=True)
    digest = frame_digest(b"header", raw)
    chain = xxhash.xxh3_128(digest)
    f.write(msgpack.packb(["header", raw, digest, *tags("header", raw)], use_bin_type=True))
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
                digest = frame_digest(key, rec_raw, buf)
                chain.update(digest)
                f.write(msgpack.packb(["block", key, rec_raw, buf, digest, *tags("block", key, rec_raw, buf)],
                                      use_bin_type=True))
                done.add(key)
                report.blocks += 1
                report.nbytes += len(buf)
                if progress is not None:
                    progress(report.nbytes, total)
    end = chain.digest()
    f.write(msgpack.packb(["end", report.blocks, end, *tags("end", report.blocks, end)], use_bin_type=True))
    return report


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
    signer = signer_of(secret)
    total = _file_size(file)
    header = _check(file, lambda n: progress(n, 2 * total) if progress else None, signer)
    path = Path(ssd_path).expanduser()
    undo = _undo_new_store(path)
    report = Report(signed=header["signed"], verified=signer is not None)
    try:
        return _import(path, file, header, report, total, progress, signer)
    except TransferError:
        raise  # (refused before a write, or the file changed midway: what was written is whole)
    except BaseException as e:
        if undo is not None:
            undo()
        if not isinstance(e, (OSError, lmdb.Error)):
            raise
        why = "no space left on its device" if is_disk_full(e) else f"cannot write to it ({e})"
        raise StorageError(
            f"{path}: {why}, after {report.blocks} blocks were written; " + (
                "the store this import made is removed: nothing is left there." if undo is not None else
                "the blocks written are each whole (`kvstore verify` passes). Free some space and import again: "
                "blocks already there are skipped.")) from None


def _import(path: Path, file: PathLike, header: dict, report: Report, total: int, progress: Optional[Progress],
            signer: Optional[Signer]) -> Report:
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
        report.block_size = size
        for root, info in header["models"]:
            if info:
                tier.register_model(root, info)
            report.models.append(_name(info, root))
        batch: list[Entry] = []
        held = 0
        with open(file, "rb") as f:
            frames = Frames(f, file, signer)
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
        if tier.usage() > tier.budget:
            report.evicted = _evict_to_budget(tier)
    finally:
        tier.close()
    return report


def _undo_new_store(path: Path) -> Optional[Callable[[], None]]:
    """Where ``path`` holds no store yet: a function removing what an import that failed made there (the store's
    files, and the folders made for it); ``None`` where a store is there (a failed import leaves it whole)."""
    if path.exists() and (not path.is_dir() or (path / "data.mdb").exists()):
        return None
    before = set(os.listdir(path)) if path.is_dir() else set()
    made = []  # folders the import creates, deepest first
    top = path
    while not top.exists():
        made.append(top)
        top = top.parent

    def undo() -> None:
        for name in set(os.listdir(path)) - before if path.is_dir() else ():
            if (path / name).is_file():
                (path / name).unlink()
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                return  # (something else was put there meanwhile: left as it is)
    return undo


def _evict_to_budget(tier: LmdbTier) -> int:
    """Delete least recently used leaves (blocks keep their use times through an export) until the store
    is under its disk budget again, as its engines evict after a write (``Disk.evict_to`` over the store's
    index): an import never leaves a store over budget. Best effort: the blocks are written either way."""
    cfg = store_config()
    table = BlockTable(0, Counters(), has_disk=True, writable=True)
    disk = Disk(tier, table, Counters(), cfg, lambda what, msg: log.warning(msg))
    try:
        disk.load_index()
        return disk.evict_to(int(tier.budget * cfg.tuning.evict_to))
    except Exception as e:
        log.warning("kvstore: %s is over its disk budget after the import and evicting failed (%s); an engine "
                    "evicts at its next write", tier.path, e)
        return 0


def _check(file: PathLike, progress: Callable[[int], None], signer: Optional[Signer]) -> dict:
    """The header of ``file`` once every frame of it checked out (``TransferError`` otherwise)."""
    with _opened(file, "rb") as f:
        frames = Frames(f, file, signer)
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
