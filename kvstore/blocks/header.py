"""The wire format of a block, and its header read into typed specs.

Wire format of a block (little-endian)::

    0   4  magic b"KVSB"
    4   2  format version
    6   2  reserved (0)
    8   4  header length H
    12  8  xxh3_64 of the header bytes
    20  H  msgpack header: the block's own key, token count, payload size and
           xxh3_64, array table
    ..     zero padding to a multiple of 64
    P      payload: token ids (int32, or int64 when an id needs it) then every
           array, each 64-byte aligned, where its table entry says (writers
           put them kind by kind where all layers are alike: every layer's
           first array, keys then values, then every second one; readers
           go by the offsets, so either order reads)

The msgpack header is a map: ``key`` (bytes), ``n`` (tokens), ``size`` and
``sum`` (payload bytes and xxh3_64), ``tok`` (the token array) and ``L``, one
entry per layer: ``None``, ``{"s": [array or None, ...]}`` (a state snapshot)
or ``{"k": tensor, "v": tensor, "w": window or None, "o": row offset}``. A
tensor is ``{"a": array}`` (dense) or ``{"q": [bits, group size], "a": [data,
scales, biases], "r": seed}`` (quantized; ``"r"`` only when rotated), an
array ``[dtype name, shape, offset, bytes]``. Only this module reads those
keys: everything else sees the typed specs (``Header``, ``KVSpec``, ...).

A quantized tensor may hold rows rotated before quantizing (``"r"``: the
seed of ``kvstore.blocks.rotation``'s transform); a block holding one is written as
format version 3, any other as version 2, so older readers refuse rotated
blocks instead of serving rotated keys or values as plain ones. Both versions
are read. Keys and values record their rotation separately.

The header is validated (checksum, dtypes, shapes against byte counts, every
array inside the buffer) before anything is allocated, so a hostile or torn
value costs at most its own size and is reported as ``BlockDecodeError``.
Arrays are read straight out of the buffer (an LMDB mmap view) into mlx memory
with a single copy. Nothing is ever unpickled.

A block carries the key it is stored under. Its rows depend on every token
before it, not only on its own tokens, so an intact block found under another
key (a misdirected write, swapped pages, a copied file) is refused rather than
served because its tokens happen to match.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from math import prod
from typing import NamedTuple, Optional, Union

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from .codec import BITS, GROUP_SIZES
from ..errors import BlockDecodeError
from .hashing import TOKEN_DTYPES
from .layers import Quantized, Tensor
from .rotation import rotatable

MAGIC = b"KVSB"
FORMAT_VERSION = 3  # 2: the header carries the block's key; 3: a tensor may be rotated ("r")
READ_VERSIONS = (2, 3)
MAX_KEY = 64
ALIGN = 64
PREFIX = struct.Struct("<4sHHIQ")  # magic, version, reserved, header len, header hash
MAX_HEADER = 1 << 20

_DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),  # numpy has no bf16: carried as raw uint16
    "float32": (mx.float32, np.dtype("<f4")),
    "uint32": (mx.uint32, np.dtype("<u4")),
    "int32": (mx.int32, np.dtype("<i4")),
    "int64": (mx.int64, np.dtype("<i8")),  # token ids outside int32 (mlx-lm's image ids)
    "uint8": (mx.uint8, np.dtype("u1")),
    "int8": (mx.int8, np.dtype("i1")),
}
NAME_OF = {mx_t: name for name, (mx_t, _) in _DTYPES.items()}
MX_OF = {name: mx_t for name, (mx_t, _) in _DTYPES.items()}


def aligned(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------- specs
# Named tuples, not dataclasses: gather compares whole layer tables block by block, and tuples compare and
# hash in C (a frozen dataclass's __eq__ runs in Python per field, per array, per layer).


class ArraySpec(NamedTuple):
    """One array of the payload: its dtype's wire name, shape, and where its
    bytes lie (``offset`` into the payload, ``nbytes`` long)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        """As numpy holds it (bfloat16: raw uint16)."""
        return _DTYPES[self.dtype][1]

    def view(self, payload: memoryview) -> np.ndarray:
        """The array in ``payload``, not copied."""
        t = self.np_dtype
        return np.frombuffer(payload, t, self.nbytes // t.itemsize, self.offset).reshape(self.shape)

    def load(self, payload: memoryview) -> mx.array:
        """The array copied into mlx memory."""
        a = mx.array(self.view(payload))
        return a.view(mx.bfloat16) if self.dtype == "bfloat16" else a

    def wire(self) -> list:
        return [self.dtype, list(self.shape), self.offset, self.nbytes]


class TensorSpec(NamedTuple):
    """A layer's keys or values: one dense array (``bits`` None), or the
    data, scales and biases of ``mx.quantize`` with its settings and the
    seed of the rotation its rows were quantized under (``None``: plain)."""

    arrays: tuple[ArraySpec, ...]
    bits: Optional[int] = None
    group_size: Optional[int] = None
    rotation: Optional[int] = None

    def load(self, payload: memoryview) -> Tensor:
        if self.bits is None:
            return self.arrays[0].load(payload)
        return Quantized(*(a.load(payload) for a in self.arrays), self.bits, self.group_size, self.rotation)

    def wire(self) -> dict:
        if self.bits is None:
            return {"a": self.arrays[0].wire()}
        out = {"q": [self.bits, self.group_size], "a": [a.wire() for a in self.arrays]}
        if self.rotation is not None:
            out["r"] = self.rotation
        return out


class KVSpec(NamedTuple):
    """An attention layer's rows, which end at the block's end and start
    ``row_offset`` rows into it (a sliding window of ``window`` rows keeps
    only the rows it can still see)."""

    keys: TensorSpec
    values: TensorSpec
    window: Optional[int] = None
    row_offset: int = 0

    def wire(self) -> dict:
        return {"k": self.keys.wire(), "v": self.values.wire(), "w": self.window, "o": self.row_offset}


class StateSpec(NamedTuple):
    """A state snapshot taken at the block's end (``None``: an empty slot)."""

    arrays: tuple[Optional[ArraySpec], ...]

    def wire(self) -> dict:
        return {"s": [None if a is None else a.wire() for a in self.arrays]}


LayerSpec = Union[KVSpec, StateSpec, None]


@functools.lru_cache(maxsize=64)
def interned(layers: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """One object for all equal layer tables. Every whole block of a model is
    laid out alike, and each block held in RAM keeps its header: shared, the
    tables cost the tier a few objects per block instead of hundreds, each of
    which the garbage collector would walk on the engine's time (its pauses:
    docs/benchmarks.md, put). Kept few: a prompt's last block has a table of
    its own length, and the whole blocks' tables, in constant use, stay."""
    return layers


@dataclass(frozen=True)
class Header:
    """A validated block header: the key the block is bound to, its token
    count, where its payload starts and the payload's xxh3_64, and where
    every array lies (one entry per model layer, ``None`` where absent).
    Equal headers describe the same byte layout."""

    key: bytes
    ntokens: int
    payload_start: int
    checksum: int
    tokens: ArraySpec
    layers: tuple[LayerSpec, ...]

    def kv_arrays(self) -> list[ArraySpec]:
        """Every array of its attention layers, layer by layer, keys then values (table order, not payload order)."""
        return [a for e in self.layers for t in (e.keys, e.values) for a in t.arrays]


# ------------------------------------------------------------------- reading


def read_header(buf: Union[bytes, memoryview]) -> Header:
    """Validate everything but the payload checksum; raise ``BlockDecodeError``."""
    buf = memoryview(buf)
    if len(buf) < PREFIX.size:
        raise BlockDecodeError(f"block of {len(buf)} bytes is shorter than its prefix")
    magic, version, reserved, hlen, hsum = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BlockDecodeError("not a kvstore block (bad magic)")
    if version not in READ_VERSIONS:
        raise BlockDecodeError(f"block format version {version}, this kvstore reads {READ_VERSIONS}")
    if reserved != 0:
        raise BlockDecodeError("reserved prefix field is not zero")
    if hlen > MAX_HEADER or PREFIX.size + hlen > len(buf):
        raise BlockDecodeError(f"header length {hlen} does not fit a {len(buf)}-byte block")
    start = aligned(PREFIX.size + hlen)
    if any(buf[PREFIX.size + hlen : start]):  # no checksum covers the padding: it must be zero
        raise BlockDecodeError("padding after the header is not zero")
    return _parsed(bytes(buf[: PREFIX.size + hlen]), len(buf))


@functools.lru_cache(maxsize=256)
def _parsed(head: bytes, nbytes: int) -> Header:
    """The rest of ``read_header``, once per exact header bytes and value
    size: a hit reads the same blocks again and again, and checking a large
    header in Python costs about what reading its payload does (figures:
    docs/design-notes.md, codec). Failures are not cached."""
    _, version, _, hlen, hsum = PREFIX.unpack_from(head, 0)
    raw = head[PREFIX.size :]
    if xxhash.xxh3_64_intdigest(raw) != hsum:
        raise BlockDecodeError("header checksum mismatch")
    try:
        fields = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage
        raise BlockDecodeError(f"header is not valid msgpack: {e}") from None
    return _header(fields, aligned(PREFIX.size + hlen), nbytes, version)


def check_key(h: Header, key: bytes) -> None:
    """Refuse a block stored under another key than its own."""
    if h.key != key:
        raise BlockDecodeError(f"block is bound to key {h.key.hex()[:16] or '(none)'}, not to the key "
                               f"{key.hex()[:16]} it is stored under (moved or overwritten)")


def _check(cond: bool, what: str):
    if not cond:
        raise BlockDecodeError(f"invalid block header: {what}")


def _is_int(x) -> bool:
    return type(x) is int  # what msgpack decodes an integer to; a bool is not one


def _array(d, size: int) -> ArraySpec:
    _check(isinstance(d, list) and len(d) == 4, "array descriptor")
    name, shape, off, n = d
    _check(isinstance(name, str) and name in _DTYPES, f"dtype {name!r}")
    # mlx shape dimensions are int32
    _check(isinstance(shape, list) and len(shape) <= 8 and all(type(s) is int and 0 <= s < 1 << 31 for s in shape), "shape")
    _check(_is_int(off) and _is_int(n) and off >= 0 and n >= 0 and off % ALIGN == 0, "offset")
    _check(off + n <= size, "array runs past the payload")
    _check(prod(shape) * _DTYPES[name][1].itemsize == n, "byte count does not match shape")
    return ArraySpec(name, tuple(shape), off, n)


def _tensor(t, size: int, rows: int, version: int) -> TensorSpec:
    _check(isinstance(t, dict) and "a" in t, "tensor")
    _check("r" not in t or ("q" in t and version >= 3 and _is_int(t["r"]) and 0 <= t["r"] < 1 << 63), "rotation")
    if "q" not in t:
        a = _array(t["a"], size)
        _check(len(a.shape) >= 2 and a.shape[-2] == rows, "rows of a dense tensor")
        return TensorSpec((a,))
    return _quantized(t, size, rows)


def _quantized(t: dict, size: int, rows: int) -> TensorSpec:
    """A quantized tensor's entry (rotation checked by ``_tensor``): its
    settings, then its three parts' dtypes and shapes against each other."""
    q = t["q"]
    _check(isinstance(q, list) and len(q) == 2 and _is_int(q[0]) and _is_int(q[1])
           and q[0] in BITS and q[1] in GROUP_SIZES, "bits/group size")
    bits, gs = q
    _check(isinstance(t["a"], list) and len(t["a"]) == 3, "quantized parts")
    d, s, b = (_array(x, size) for x in t["a"])
    ds, ss, bs = d.shape, s.shape, b.shape
    _check(d.dtype == "uint32" and s.dtype == b.dtype and s.dtype in ("float16", "bfloat16", "float32"),
           "quantized dtypes")
    _check(len(ds) >= 2 and ds[:-1] == ss[:-1] == bs[:-1] and ss == bs, "quantized shapes")
    _check(ds[-2] == rows, "rows of a quantized tensor")
    dim = ds[-1] * 32 // bits
    _check(ds[-1] * 32 % bits == 0 and dim % gs == 0 and ss[-1] == dim // gs, "quantized dims")
    _check("r" not in t or rotatable(dim), "rotated dim")
    return TensorSpec((d, s, b), bits, gs, t.get("r"))


def _layer(entry, size: int, n: int, version: int) -> LayerSpec:
    if entry is None:
        return None
    _check(isinstance(entry, dict), "layer entry")
    if "s" in entry:
        _check(isinstance(entry["s"], list), "state arrays")
        return StateSpec(tuple(None if d is None else _array(d, size) for d in entry["s"]))
    _check("k" in entry and "v" in entry, "layer keys/values")
    w = entry.get("w")
    _check(w is None or (_is_int(w) and w > 0), "window")
    o = entry.get("o", 0)
    _check(_is_int(o) and 0 <= o < max(n, 1) and (o == 0 or w is not None), "row offset")
    return KVSpec(_tensor(entry["k"], size, n - o, version), _tensor(entry["v"], size, n - o, version), w, o)


def _header(f, start: int, nbytes: int, version: int) -> Header:
    """The typed header of ``f``, a decoded msgpack map, checked against a
    payload of ``nbytes - start`` bytes."""
    size = nbytes - start
    _check(isinstance(f, dict), "not a map")
    _check(isinstance(f.get("key"), bytes) and len(f["key"]) <= MAX_KEY, "block key")
    _check(_is_int(f.get("n")) and f["n"] >= 0, "token count")
    _check(f.get("size") == size, "payload size does not match the value size (truncated?)")
    _check(_is_int(f.get("sum")), "payload checksum")
    tok = _array(f.get("tok"), size)
    _check(tok.np_dtype in TOKEN_DTYPES and tok.shape == (f["n"],), "token array")
    _check(isinstance(f.get("L"), list) and len(f["L"]) <= 4096, "layer table")
    layers = interned(tuple(_layer(e, size, f["n"], version) for e in f["L"]))
    return Header(f["key"], f["n"], start, f["sum"], tok, layers)


