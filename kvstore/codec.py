"""One block of KV: compress its tensors, and (de)serialize it to one buffer.

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
           array, each 64-byte aligned

A quantized tensor may hold rows rotated before quantizing (``"r"``: the
seed of ``kvstore.rotation``'s transform); a block holding one is written as
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
from typing import Any, Optional, Union

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from . import buffers, cuda
from .config import StoreConfig
from .errors import BlockDecodeError, ConfigError
from .hashing import TOKEN_DTYPES, narrowest
from .layers import KVLayer, Layer, Quantized, StateLayer, Tensor, tensor_rows
from .rotation import DEFAULT_SEED, rotatable, rotate

MAGIC = b"KVSB"
FORMAT_VERSION = 3  # 2: the header carries the block's key; 3: a tensor may be rotated ("r")
READ_VERSIONS = (2, 3)
MAX_KEY = 64
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQ")  # magic, version, reserved, header len, header hash
MAX_HEADER = 1 << 20

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)

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
_NAME_OF = {mx_t: name for name, (mx_t, _) in _DTYPES.items()}


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of an array a block header names ``name`` (bfloat16: raw uint16)."""
    return _DTYPES[name][1]


@dataclass
class Block:
    """A run of tokens and, per model layer, its rows of KV (or a state
    snapshot taken at the block's end, or ``None`` where it is absent)."""

    tokens: np.ndarray  # int32, or int64 when an id needs it
    layers: list[Optional[Layer]]

    def __post_init__(self):
        # the width this block's own ids need: text blocks of an image prompt stay int32
        self.tokens = narrowest(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(l.nbytes for l in self.layers if l is not None)

    def describe(self) -> tuple[str, str]:
        """(how KV is kept, e.g. "K8/V4 g64" or "dense", and its dtype)."""
        kv = next((l for l in self.layers if isinstance(l, KVLayer)), None)
        if kv is None:
            return "state only", "-"
        k, v = kv.keys, kv.values
        dtype = str(k.dtype).split(".")[-1]
        if not isinstance(k, Quantized) and not isinstance(v, Quantized):
            return "dense", dtype
        kb = f"K{k.bits}{'r' if k.rotation is not None else ''}" if isinstance(k, Quantized) else "K16"
        vb = f"V{v.bits}{'r' if v.rotation is not None else ''}" if isinstance(v, Quantized) else "V16"
        g = k.group_size if isinstance(k, Quantized) else v.group_size
        return f"{kb}/{vb} g{g}", dtype


# ----------------------------------------------------------------- compression


def _fit_group(dim: int, group_size: int) -> Optional[int]:
    """Largest supported group size <= ``group_size`` dividing ``dim``."""
    for g in sorted((g for g in GROUP_SIZES if g <= group_size), reverse=True):
        if dim % g == 0:
            return g
    return None


def _default_rotation(bits: Optional[int], limit: Optional[int]) -> bool:
    return bits is not None and limit is not None and bits <= limit


@dataclass(frozen=True)
class Codec:
    """How a store keeps KV: ``None`` bits keep the engine's dtype as given,
    otherwise ``mx.quantize`` with that many bits (keys and values separately).
    ``rotate_keys`` rotates keys by ``kvstore.rotation``'s fixed Hadamard
    transform before quantizing them (undone on restore): outlier channels
    then spread over their group instead of setting its scale.
    ``rotate_values`` does the same to values (attention output is linear in
    V, so ``V = V' R`` on restore is exact up to quantization)."""

    key_bits: Optional[int] = None
    value_bits: Optional[int] = None
    group_size: int = 64
    rotate_keys: bool = False
    rotate_values: bool = False

    def __post_init__(self):
        for b in (self.key_bits, self.value_bits):
            if b is not None and b not in BITS:
                raise ConfigError(f"kv_bits must be one of {BITS} or None, got {b}")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"kv_group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.rotate_keys and self.key_bits is None:
            raise ConfigError("rotate_keys needs quantized keys (key bits, not None)")
        if self.rotate_values and self.value_bits is None:
            raise ConfigError("rotate_values needs quantized values (value bits, not None)")

    @classmethod
    def from_bits(cls, kv_bits: Union[None, int, tuple], group_size: int = 64,
                  rotate_keys: Optional[bool] = None, rotate_values: Optional[bool] = None,
                  rotate_keys_at_or_below: Optional[int] = StoreConfig.rotate_keys_at_or_below,
                  rotate_values_at_or_below: Optional[int] = StoreConfig.rotate_values_at_or_below) -> "Codec":
        """``kv_bits``: an int for both, or ``(key_bits, value_bits)``.
        ``rotate_keys=None`` rotates keys of ``rotate_keys_at_or_below`` bits or fewer,
        ``rotate_values=None`` values of ``rotate_values_at_or_below`` bits or fewer
        (``StoreConfig`` says why)."""
        if kv_bits is None or isinstance(kv_bits, int) and not isinstance(kv_bits, bool):
            k, v = kv_bits, kv_bits
        elif isinstance(kv_bits, tuple) and len(kv_bits) == 2 and all(
                b is None or isinstance(b, int) and not isinstance(b, bool) for b in kv_bits):
            k, v = kv_bits
        else:
            raise ConfigError(f"kv_bits must be None, an int of {BITS} or a pair (key_bits, value_bits), "
                              f"got {kv_bits!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ConfigError(f"kv_group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        for name, r in (("rotate_keys", rotate_keys), ("rotate_values", rotate_values)):
            if r is not None and not isinstance(r, bool):
                raise ConfigError(f"{name} must be True, False or None, got {r!r}")
        if rotate_keys is None:
            rotate_keys = _default_rotation(k, rotate_keys_at_or_below)
        if rotate_values is None:
            rotate_values = _default_rotation(v, rotate_values_at_or_below)
        return cls(k, v, group_size, bool(rotate_keys), bool(rotate_values))

    def compress_keys(self, t: Tensor) -> Tensor:
        return convert(t, self.key_bits, self.group_size, DEFAULT_SEED if self.rotate_keys else None)

    def compress_values(self, t: Tensor) -> Tensor:
        return convert(t, self.value_bits, self.group_size, DEFAULT_SEED if self.rotate_values else None)

    def describe(self) -> str:
        if self.key_bits is None and self.value_bits is None:
            return "as given"
        return (f"K{self.key_bits or 16}{'r' if self.rotate_keys else ''}/"
                f"V{self.value_bits or 16}{'r' if self.rotate_values else ''} g{self.group_size}")


def convert(t: Tensor, bits: Optional[int], group_size: int, rotation: Optional[int] = None) -> Tensor:
    """``t`` kept as given (``bits=None``) or quantized with ``bits``, its rows
    rotated first when ``rotation`` (a seed) is given and the dim allows it.

    A tensor already quantized with the wanted bits and group passes through
    without touching its data, also when it is unrotated and a rotation is
    asked for (quantizing again would only add error); other settings go
    through the dense values once, so ``rotation=None`` always returns plain
    rows. A head dim no supported group divides stays dense rather than fail.
    """
    if bits is None:
        return t
    if isinstance(t, Quantized):
        if t.bits == bits and t.group_size == group_size and t.rotation in (None, rotation):
            return t
        t = t.dequantize()
    g = _fit_group(t.shape[-1], group_size)
    if g is None:
        return t
    if rotation is not None and not rotatable(t.shape[-1]):
        rotation = None
    data, scales, biases = mx.quantize(t if rotation is None else rotate(t, rotation), group_size=g, bits=bits)
    return Quantized(data, scales, biases, bits, g, rotation)


def densify(t: Tensor) -> mx.array:
    return t.dequantize() if isinstance(t, Quantized) else t


# --------------------------------------------------------------- serialization


def _np_view(a: mx.array) -> np.ndarray:
    """The array's memory as numpy sees it (strided where ``a`` is a slice)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


class _Writer:
    def __init__(self):
        self.parts: list[tuple[int, mx.array]] = []
        self.size = 0
        self.rotated = False  # a rotated tensor needs format version 3

    def add(self, a: mx.array) -> list:
        if a.dtype not in _NAME_OF:
            raise BlockDecodeError(f"dtype {a.dtype} cannot be stored")
        off = self.size
        self.parts.append((off, a))
        self.size = _align(off + a.nbytes)
        return [_NAME_OF[a.dtype], list(a.shape), off, a.nbytes]

    def tensor(self, t: Tensor) -> dict:
        if isinstance(t, Quantized):
            out = {"q": [t.bits, t.group_size], "a": [self.add(x) for x in t.arrays()]}
            if t.rotation is not None:
                out["r"] = t.rotation
                self.rotated = True
            return out
        return {"a": self.add(t)}

    def fill(self, payload: memoryview) -> int:
        """Every array into its place in ``payload``, the alignment gaps
        zeroed; returns the payload's checksum, taken on the way (each part
        hashed while its bytes are still in the cache)."""
        rt = cuda.runtime()
        if rt is not None and 0 < self.size < 1 << 31:
            # on CUDA the arrays live on the device: laid out there in one buffer, then one transfer
            # through the copy engine (page faults, or a copy per array, would cost far more)
            pieces, pos = [], 0
            for off, a in self.parts:
                if off > pos:
                    pieces.append(mx.zeros((off - pos,), mx.uint8))
                if a.nbytes:
                    pieces.append(mx.contiguous(a).view(mx.uint8).reshape(-1))
                    pos = off + a.nbytes
            if self.size > pos:
                pieces.append(mx.zeros((self.size - pos,), mx.uint8))
            packed = mx.concatenate(pieces)
            mx.eval(packed)
            mx.synchronize()
            h = xxhash.xxh3_64()
            cuda.download(rt, np.frombuffer(payload, np.uint8), cuda.address(packed), h)
            return h.intdigest()
        dst = np.frombuffer(payload, np.uint8)
        h = xxhash.xxh3_64()
        ends = [off for off, _ in self.parts[1:]] + [self.size]
        for (off, a), end in zip(self.parts, ends):
            if a.nbytes:  # straight from the array's own memory: a slice of the engine's buffer is not copied first
                src = _np_view(a)
                np.copyto(dst[off : off + a.nbytes].view(src.dtype).reshape(src.shape), src)
            dst[off + a.nbytes : end] = 0
            h.update(payload[off:end])
        return h.intdigest()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_SUM_PLACEHOLDER = 1 << 63  # packed in 9 bytes, like every checksum at or above 2**32


def serialize(block: Block, key: bytes = b"") -> memoryview:
    """One buffer holding the whole block, bound to ``key`` (see the module
    docstring). It is numpy memory: numpy asks the kernel for huge pages, so
    a fresh buffer fills ~4x faster than a ``bytearray`` (measured on Linux)."""
    return _serialize(block, key)[0]


def _serialize(block: Block, key: bytes) -> tuple[memoryview, "Header"]:
    w = _Writer()
    tok = w.add(mx.array(block.tokens))
    table: list[Any] = []
    for layer in block.layers:
        if layer is None:
            table.append(None)
        elif isinstance(layer, KVLayer):
            table.append({"k": w.tensor(layer.keys), "v": w.tensor(layer.values), "w": layer.window,
                          "o": len(block.tokens) - tensor_rows(layer.keys)})  # rows end at the block's end
        else:
            table.append({"s": [None if a is None else w.add(a) for a in layer.arrays]})
    # the header's size does not depend on the checksum's value (msgpack packs it as a uint64 either way),
    # so the payload goes straight into its final place: one copy of the KV in all
    fields = {"key": bytes(key), "n": int(len(block.tokens)), "size": w.size, "sum": _SUM_PLACEHOLDER,
              "tok": tok, "L": table}
    start = _align(_PREFIX.size + len(msgpack.packb(fields, use_bin_type=True)))
    arr = _buffer(start + w.size)
    out = memoryview(arr)
    out[:start] = bytes(start)
    payload = out[start:]
    fields["sum"] = w.fill(payload)
    header = msgpack.packb(fields, use_bin_type=True)
    version = FORMAT_VERSION if w.rotated else 2
    head = _PREFIX.pack(MAGIC, version, 0, len(header), xxhash.xxh3_64_intdigest(header)) + header
    n = fields["n"]
    if _align(len(head)) != start:  # a checksum below 2**32 packs shorter (1 in 2**32 blocks)
        start = _align(len(head))
        whole = np.concatenate([np.frombuffer(head + bytes(start - len(head)), np.uint8),
                                np.frombuffer(payload, np.uint8)])
        return _frozen(whole), Header(n, start, fields)
    out[: len(head)] = head  # the rest up to ``start`` is still zero
    return _frozen(arr), Header(n, start, fields)


_PAGE = 4096
_IN_PAGE = 64  # where a large buffer starts within its page


def _buffer(n: int) -> np.ndarray:
    """``n`` bytes of numpy memory for a serialized block. A large one starts
    64 bytes into a page, not at a page boundary: LMDB puts a value 16 bytes
    into its first page, and glibc copies a page-aligned source to that offset
    with a loop that took a page fault per 4 KiB of LMDB's map (65,499 faults
    and 0.21 s per 256 MiB on the CPU box; 2,842 and 0.055 s from this offset)."""
    if n < 1 << 20:
        return np.empty(n, np.uint8)
    raw = buffers.take(n + _PAGE)
    skip = (_IN_PAGE - raw.ctypes.data) % _PAGE
    return raw[skip : skip + n]


@dataclass
class Header:
    """A validated block header, with where its payload starts."""

    ntokens: int
    payload_start: int
    fields: dict

    @property
    def layers(self) -> list:
        return self.fields["L"]


def read_header(buf: Union[bytes, memoryview]) -> Header:
    """Validate everything but the payload checksum; raise ``BlockDecodeError``."""
    buf = memoryview(buf)
    if len(buf) < _PREFIX.size:
        raise BlockDecodeError(f"block of {len(buf)} bytes is shorter than its prefix")
    magic, version, reserved, hlen, hsum = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BlockDecodeError("not a kvstore block (bad magic)")
    if version not in READ_VERSIONS:
        raise BlockDecodeError(f"block format version {version}, this kvstore reads {READ_VERSIONS}")
    if reserved != 0:
        raise BlockDecodeError("reserved prefix field is not zero")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(buf):
        raise BlockDecodeError(f"header length {hlen} does not fit a {len(buf)}-byte block")
    start = _align(_PREFIX.size + hlen)
    if any(buf[_PREFIX.size + hlen : start]):  # no checksum covers the padding: it must be zero
        raise BlockDecodeError("padding after the header is not zero")
    return _parsed(bytes(buf[: _PREFIX.size + hlen]), len(buf))


@functools.lru_cache(maxsize=256)
def _parsed(head: bytes, nbytes: int) -> Header:
    """The rest of ``read_header``, once per exact header bytes and value
    size: hits read the same blocks again and again, and checking a 32-layer
    header in Python costs ~0.6 ms on the CPU box, about what reading its
    32 MiB costs. A parsed 32-layer header takes ~90 KB of Python objects:
    256 of them (a 64K-token prompt at block 256) hold ~23 MB. (Failures are
    not cached; callers never modify a Header.)"""
    _, version, _, hlen, hsum = _PREFIX.unpack_from(head, 0)
    raw = head[_PREFIX.size :]
    if xxhash.xxh3_64_intdigest(raw) != hsum:
        raise BlockDecodeError("header checksum mismatch")
    try:
        fields = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage
        raise BlockDecodeError(f"header is not valid msgpack: {e}") from None
    start = _align(_PREFIX.size + hlen)
    _validate(fields, nbytes - start, version)
    return Header(fields["n"], start, fields)


def check_key(h: Header, key: bytes) -> None:
    """Refuse a block stored under another key than its own."""
    if h.fields["key"] != key:
        raise BlockDecodeError(f"block is bound to key {h.fields['key'].hex()[:16] or '(none)'}, not to the key "
                               f"{key.hex()[:16]} it is stored under (moved or overwritten)")


def _check(cond: bool, what: str):
    if not cond:
        raise BlockDecodeError(f"invalid block header: {what}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_array(d, size: int) -> tuple:
    _check(isinstance(d, list) and len(d) == 4, "array descriptor")
    name, shape, off, n = d
    _check(isinstance(name, str) and name in _DTYPES, f"dtype {name!r}")
    # mlx shape dimensions are int32
    _check(isinstance(shape, list) and len(shape) <= 8 and all(_is_int(s) and 0 <= s < 1 << 31 for s in shape), "shape")
    _check(_is_int(off) and _is_int(n) and off >= 0 and n >= 0 and off % ALIGN == 0, "offset")
    _check(off + n <= size, "array runs past the payload")
    _check(prod(shape) * _DTYPES[name][1].itemsize == n, "byte count does not match shape")
    return name, shape


def _validate_tensor(t, size: int, rows: int, version: int) -> None:
    _check(isinstance(t, dict) and "a" in t, "tensor")
    _check("r" not in t or ("q" in t and version >= 3 and _is_int(t["r"]) and 0 <= t["r"] < 1 << 63), "rotation")
    if "q" not in t:
        _, shape = _validate_array(t["a"], size)
        _check(len(shape) >= 2 and shape[-2] == rows, "rows of a dense tensor")
        return
    q = t["q"]
    _check(isinstance(q, list) and len(q) == 2 and _is_int(q[0]) and _is_int(q[1])
           and q[0] in BITS and q[1] in GROUP_SIZES, "bits/group size")
    bits, gs = q
    _check(isinstance(t["a"], list) and len(t["a"]) == 3, "quantized parts")
    (dn, ds), (sn, ss), (bn, bs) = (_validate_array(d, size) for d in t["a"])
    _check(dn == "uint32" and sn == bn and sn in ("float16", "bfloat16", "float32"), "quantized dtypes")
    _check(len(ds) >= 2 and ds[:-1] == ss[:-1] == bs[:-1] and ss == bs, "quantized shapes")
    _check(ds[-2] == rows, "rows of a quantized tensor")
    dim = ds[-1] * 32 // bits
    _check(ds[-1] * 32 % bits == 0 and dim % gs == 0 and ss[-1] == dim // gs, "quantized dims")
    _check("r" not in t or rotatable(dim), "rotated dim")


def _validate(f, size: int, version: int) -> None:
    _check(isinstance(f, dict), "not a map")
    _check(isinstance(f.get("key"), bytes) and len(f["key"]) <= MAX_KEY, "block key")
    _check(_is_int(f.get("n")) and f["n"] >= 0, "token count")
    _check(f.get("size") == size, "payload size does not match the value size (truncated?)")
    _check(_is_int(f.get("sum")), "payload checksum")
    name, shape = _validate_array(f.get("tok"), size)
    _check(_DTYPES[name][1] in TOKEN_DTYPES and shape == [f["n"]], "token array")
    _check(isinstance(f.get("L"), list) and len(f["L"]) <= 4096, "layer table")
    for entry in f["L"]:
        if entry is None:
            continue
        _check(isinstance(entry, dict), "layer entry")
        if "s" in entry:
            _check(isinstance(entry["s"], list), "state arrays")
            for d in entry["s"]:
                if d is not None:
                    _validate_array(d, size)
        else:
            _check("k" in entry and "v" in entry, "layer keys/values")
            _check(entry.get("w") is None or (_is_int(entry["w"]) and entry["w"] > 0), "window")
            o = entry.get("o", 0)
            _check(_is_int(o) and 0 <= o < max(f["n"], 1) and (o == 0 or entry.get("w") is not None), "row offset")
            _validate_tensor(entry["k"], size, f["n"] - o, version)
            _validate_tensor(entry["v"], size, f["n"] - o, version)


def _array(payload: memoryview, d) -> mx.array:
    name, shape, off, n = d
    mx_t, np_t = _DTYPES[name]
    a = mx.array(np.frombuffer(payload, dtype=np_t, count=n // np_t.itemsize, offset=off).reshape(shape))
    return a.view(mx_t) if name == "bfloat16" else a


def _tensor(payload: memoryview, t) -> Tensor:
    if "q" in t:
        bits, gs = t["q"]
        return Quantized(*(_array(payload, d) for d in t["a"]), bits, gs, t.get("r"))
    return _array(payload, t["a"])


def deserialize(buf: Union[bytes, memoryview], start: int = 0, verify: bool = True,
                key: Optional[bytes] = None) -> Block:
    """Decode a block whose first token sits at position ``start`` of its prompt.

    Raises ``BlockDecodeError`` for anything malformed, or for a block bound
    to another key than ``key`` (when given); with ``verify`` the payload
    checksum is checked too (a fast xxh3 pass over the bytes).
    """
    buf = memoryview(buf)
    h = read_header(buf)
    if key is not None:
        check_key(h, key)
    payload = buf[h.payload_start :]
    if verify and xxhash.xxh3_64_intdigest(payload) != h.fields["sum"]:
        raise BlockDecodeError("payload checksum mismatch")
    name, shape, off, n = h.fields["tok"]
    tokens = np.frombuffer(payload, dtype=_DTYPES[name][1], count=h.ntokens, offset=off).copy()
    layers: list[Optional[Layer]] = []
    for entry in h.layers:
        if entry is None:
            layers.append(None)
        elif "s" in entry:
            layers.append(StateLayer([None if d is None else _array(payload, d) for d in entry["s"]]))
        else:
            layers.append(KVLayer(_tensor(payload, entry["k"]), _tensor(payload, entry["v"]),
                                  start + entry.get("o", 0), entry.get("w")))
    arrays = [a for l in layers if l is not None for a in layer_arrays(l)]
    if arrays:
        mx.eval(arrays)  # copy out of the buffer now: it may be an mmap view that ends with its transaction
    return Block(tokens, layers)


@dataclass
class Stored:
    """A block as its serialized bytes, header validated and bound to ``key``.

    ``buf`` is the whole value: an LMDB mmap view (valid only inside its read
    transaction; payload not checked yet) or bytes this process holds (the
    RAM tier: ``checked``, their checksum was verified or computed here).
    Held this way a block costs exactly its stored size, and every tier hands
    ``gather`` the same thing to copy from.
    """

    key: bytes
    start: int
    buf: memoryview
    header: Header
    checked: bool = False

    @classmethod
    def pack(cls, block: Block, key: bytes, start: int) -> "Stored":
        """``block`` serialized (its header is the one just written: no
        second parse)."""
        buf, header = _serialize(block, key)
        return cls(key, start, buf, header, True)

    @classmethod
    def of(cls, buf, key: bytes, start: int, checked: bool = False) -> "Stored":
        """Raise ``BlockDecodeError`` for a malformed value or one bound to another key."""
        buf = memoryview(buf)
        h = read_header(buf)
        check_key(h, key)
        return cls(key, start, buf, h, checked)

    @property
    def payload(self) -> memoryview:
        return self.buf[self.header.payload_start :]

    @property
    def nbytes(self) -> int:
        return len(self.buf)

    @property
    def tokens(self) -> np.ndarray:
        name, _, off, _ = self.header.fields["tok"]
        return np.frombuffer(self.payload, dtype=np_dtype(name), count=self.header.ntokens, offset=off)

    def intact(self) -> bool:
        """The payload checksum (xxh3 releases the GIL: threads hash side by side)."""
        return self.checked or xxhash.xxh3_64_intdigest(self.payload) == self.header.fields["sum"]

    def held(self) -> Optional["Stored"]:
        """A checked copy in memory of its own (out of an mmap view that ends
        with its transaction), or ``None`` when the payload is corrupt."""
        arr = _buffer(len(self.buf))
        arr[:] = np.frombuffer(self.buf, np.uint8)
        copy = Stored(self.key, self.start, _frozen(arr), self.header)
        if not copy.intact():  # the copy is what is kept: check that
            return None
        copy.checked = True
        return copy

    def decode(self) -> Block:
        return deserialize(self.buf, self.start, verify=not self.checked, key=self.key)


def _frozen(arr: np.ndarray) -> memoryview:
    """A read-only view: bytes kept as checked are never written again."""
    arr.flags.writeable = False
    return memoryview(arr)


def layer_arrays(layer: Layer) -> list[mx.array]:
    """Every mlx array a layer holds (state slots left empty skipped)."""
    if isinstance(layer, StateLayer):
        return [a for a in layer.arrays if a is not None]
    out = []
    for t in (layer.keys, layer.values):
        out.extend(t.arrays() if isinstance(t, Quantized) else [t])
    return out


def block_arrays(block: Block) -> list[mx.array]:
    """Every mlx array a block holds (to evaluate them in one call)."""
    return [a for l in block.layers if l is not None for a in layer_arrays(l)]
