"""A block as bytes: ``serialize`` and ``deserialize`` (the format is
``kvstore.blocks.header``'s), and ``Stored``, a block held as its serialized bytes."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Optional, Union

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from ..gpu import buffers, cuda
from ..gpu.backend import Backend, choose
from .codec import Block, block_arrays
from ..errors import BlockDecodeError
from .header import (FORMAT_VERSION, MAGIC, NAME_OF, PREFIX, ArraySpec, Header, KVSpec, LayerSpec, StateSpec,
                     TensorSpec, aligned, check_key, interned, read_header)
from .layers import KVLayer, Layer, Quantized, StateLayer, Tensor, tensor_arrays, tensor_rows

# --------------------------------------------------------------- serialization


def _np_view(a: mx.array) -> np.ndarray:
    """The array's memory as numpy sees it (strided where ``a`` is a slice)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


class _Layout:
    """Where each array of a block goes in its payload, and the copy there."""

    def __init__(self):
        self.parts: list[tuple[int, mx.array]] = []
        self.size = 0
        self.rotated = False  # a rotated tensor needs format version 3

    def add(self, a: mx.array) -> ArraySpec:
        if a.dtype not in NAME_OF:
            raise BlockDecodeError(f"dtype {a.dtype} cannot be stored")
        off = self.size
        self.parts.append((off, a))
        self.size = aligned(off + a.nbytes)
        return ArraySpec(NAME_OF[a.dtype], tuple(a.shape), off, a.nbytes)

    def tensor(self, t: Tensor) -> TensorSpec:
        return self._spec(t, tuple(self.add(x) for x in tensor_arrays(t)))

    def layers(self, layers: list[Optional[Layer]], ntokens: int) -> tuple[LayerSpec, ...]:
        """Every layer's arrays placed. Where every layer is an attention layer
        whose tensors have as many arrays each (plain, or quantized alike) they
        go kind by kind: every layer's first array (keys, then values), then
        every second one... So each kind's (layer, tensor, head) lines are
        evenly spaced, and a hit lands each kind on the GPU with one strided
        copy per block (``kvstore.convert.rowcopy``). For dense layers this is the
        layer-by-layer order."""
        parts = [tensor_arrays(t) for l in layers if isinstance(l, KVLayer) for t in (l.keys, l.values)]
        if len(parts) != 2 * len(layers) or len({len(p) for p in parts}) != 1:
            return tuple(self.layer(l, ntokens) for l in layers)
        placed = list(zip(*[[self.add(a) for a in kind] for kind in zip(*parts)]))
        return tuple(KVSpec(self._spec(l.keys, placed[2 * i]), self._spec(l.values, placed[2 * i + 1]), l.window,
                            ntokens - tensor_rows(l.keys)) for i, l in enumerate(layers))

    def _spec(self, t: Tensor, arrays: tuple[ArraySpec, ...]) -> TensorSpec:
        if not isinstance(t, Quantized):
            return TensorSpec(arrays)
        # (int(): a caller's settings may be numpy ints, which msgpack refuses and equal tables would share)
        self.rotated = self.rotated or t.rotation is not None
        return TensorSpec(arrays, int(t.bits), int(t.group_size), None if t.rotation is None else int(t.rotation))

    def layer(self, layer: Optional[Layer], ntokens: int) -> LayerSpec:
        if layer is None:
            return None
        if isinstance(layer, KVLayer):  # rows end at the block's end
            return KVSpec(self.tensor(layer.keys), self.tensor(layer.values), layer.window,
                          ntokens - tensor_rows(layer.keys))
        return StateSpec(tuple(None if a is None else self.add(a) for a in layer.arrays))

    def packed(self, rows: list[Optional[mx.array]]) -> mx.array:
        """Payloads laid out on the device, ``[n, size]`` uint8: ``rows`` gives
        each part's bytes in ``n`` payloads as ``[n, its bytes]`` (``None`` for
        an empty one); the alignment gaps are zeroed."""
        n = next(r for r in rows if r is not None).shape[0]
        pieces, pos = [], 0
        for (off, a), r in zip(self.parts, rows, strict=True):
            if off > pos:
                pieces.append(mx.zeros((n, off - pos), mx.uint8))
            if a.nbytes:
                pieces.append(r)
                pos = off + a.nbytes
        if self.size > pos:
            pieces.append(mx.zeros((n, self.size - pos), mx.uint8))
        return mx.concatenate(pieces, axis=1)

    def fill(self, payload: memoryview, backend: Backend) -> int:
        """Every array into its place in ``payload``, the alignment gaps
        zeroed; returns the payload's checksum, taken on the way (each part
        hashed while its bytes are still in the cache)."""
        rt = backend.runtime
        if rt is not None and 0 < self.size < 1 << 31:
            # on CUDA the arrays live on the device: laid out there in one buffer, then one transfer
            # through the copy engine (page faults, or a copy per array, would cost far more)
            packed = self.packed([mx.contiguous(a).view(mx.uint8).reshape(1, -1) if a.nbytes else None
                                  for _, a in self.parts])
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


_SUM_PLACEHOLDER = 1 << 63  # packed in 9 bytes, like every checksum at or above 2**32


def serialize(block: Block, key: bytes = b"", backend: Optional[Backend] = None) -> memoryview:
    """One buffer holding the whole block, bound to ``key`` (see the module
    docstring). It is numpy memory, which fills faster than a ``bytearray``
    (numpy asks the kernel for huge pages). ``backend``: where the block's
    arrays live (default: ``choose()``)."""
    return _serialize(block, key, backend or choose())[0]


def _serialize(block: Block, key: bytes, backend: Backend) -> tuple[memoryview, Header]:
    plan = _Plan(block, key)
    arr = plan.buffer()
    return plan.seal(arr, plan.layout.fill(memoryview(arr)[plan.start :], backend))


class _Plan:
    """A block's layout and header fields: the payload goes straight into its
    final place after ``start`` (one copy of the KV in all), then ``seal``
    writes the header with the payload's checksum. The header's size does not
    depend on the checksum's value (msgpack packs it as a uint64 either way)."""

    def __init__(self, block: Block, key: bytes):
        self.layout = w = _Layout()
        self.key, self.n = bytes(key), int(len(block.tokens))
        self.tok = w.add(mx.array(block.tokens))
        self.layers = interned(w.layers(block.layers, self.n))
        self.fields = {"key": self.key, "n": self.n, "size": w.size, "sum": _SUM_PLACEHOLDER, "tok": self.tok.wire(),
                       "L": [None if l is None else l.wire() for l in self.layers]}
        self.start = self._payload_start()

    def keyed(self, key: bytes) -> "_Plan":
        """The plan of a block laid out as this one, bound to ``key``."""
        p = copy.copy(self)
        p.key = bytes(key)
        p.fields = dict(self.fields, key=p.key)
        if len(p.key) != len(self.key):
            p.start = p._payload_start()
        return p

    def _payload_start(self) -> int:
        """Where the payload starts: after the prefix and the packed header fields, aligned."""
        return aligned(PREFIX.size + len(msgpack.packb(self.fields, use_bin_type=True)))

    def buffer(self) -> np.ndarray:
        """The block's buffer, zeros up to where the payload starts."""
        arr = _buffer(self.start + self.layout.size)
        arr[: self.start] = 0
        return arr

    def seal(self, arr: np.ndarray, checksum: int) -> tuple[memoryview, Header]:
        """The header written in front of the payload filled in ``arr``."""
        fields = dict(self.fields, sum=checksum)
        header = msgpack.packb(fields, use_bin_type=True)
        version = FORMAT_VERSION if self.layout.rotated else 2
        head = PREFIX.pack(MAGIC, version, 0, len(header), xxhash.xxh3_64_intdigest(header)) + header
        start = self.start
        if aligned(len(head)) != start:  # a checksum below 2**32 packs shorter (1 in 2**32 blocks)
            start = aligned(len(head))
            arr = np.concatenate([np.frombuffer(head + bytes(start - len(head)), np.uint8), arr[self.start :]])
        else:
            arr[: len(head)] = np.frombuffer(head, np.uint8)  # the rest up to ``start`` is still zero
        return _frozen(arr), Header(self.key, self.n, start, checksum, self.tok, self.layers)


def serialize_run(whole: Block, first: Block, keys: list[bytes],
                  backend: Optional[Backend] = None) -> Iterator[tuple[memoryview, Header]]:
    """The blocks of ``whole``'s rows, one per key, each as many rows as
    ``first`` (the first of them, cut from ``whole``: every one is laid out
    as it is, so its plan is theirs under another key), serialized together:
    each array of ``whole`` is copied once into the ``[blocks, payload
    bytes]`` matrix of their payloads (on the GPU on CUDA, where a copy per
    block per array would cost a kernel each), then each row goes to its
    block's buffer (one download on CUDA), hashed on the way. Yields in
    order, as each is done. ``backend``: where the arrays live (default: ``choose()``)."""
    n = len(keys)
    if len(whole.tokens) != n * len(first.tokens):
        raise ValueError(f"a run of {n} blocks of {len(first.tokens)} rows cannot hold {len(whole.tokens)} rows")
    plan = _Plan(first, keys[0])
    big = _Layout()
    big.add(mx.array(whole.tokens))
    big.layers(whole.layers, len(whole.tokens))
    layout = plan.layout
    packed = layout.packed([_rows_of_blocks(full, n) if a.nbytes else None
                            for (_, a), (_, full) in zip(layout.parts, big.parts, strict=True)])
    mx.eval(packed)
    del whole, first, big  # the run's arrays go now: only its payloads are held
    layout.parts.clear()
    rt = (backend or choose()).runtime
    if rt is not None:
        mx.synchronize()
        base = cuda.address(packed)  # (mlx's buffer cache hands the next run this one's moved buffer)
    host = None if rt is not None else np.asarray(packed)
    for i, key in enumerate(keys):
        p = plan.keyed(key)
        arr = p.buffer()
        dst = arr[p.start :]
        h = xxhash.xxh3_64()
        if rt is not None:
            cuda.download(rt, dst, base + i * layout.size, h)
        else:
            np.copyto(dst, host[i])
            h.update(dst)
        yield p.seal(arr, h.intdigest())


def _rows_of_blocks(a: mx.array, n: int) -> mx.array:
    """``a``'s bytes as ``[n, bytes]``, row ``i`` holding block ``i``'s rows
    (token axis: -2 of KV arrays, 0 of the token ids) as its own array would."""
    if a.ndim == 1:
        return a.reshape(n, -1).view(mx.uint8)
    *lead, rows, last = a.shape
    per = a.reshape(math.prod(lead), n, rows // n, last).transpose(1, 0, 2, 3)
    return mx.contiguous(per).view(mx.uint8).reshape(n, -1)


_PAGE = 4096
_IN_PAGE = 64  # where a large buffer starts within its page


def _buffer(n: int) -> np.ndarray:
    """``n`` bytes of numpy memory for a serialized block. A large one starts
    64 bytes into a page: LMDB puts a value 16 bytes into its first page, and
    glibc copies a page-aligned source there with a loop that faults once
    per 4 KiB of the map (docs/design-notes.md, codec)."""
    if n < 1 << 20:
        return np.empty(n, np.uint8)
    raw = buffers.take(n + _PAGE)
    skip = (_IN_PAGE - raw.ctypes.data) % _PAGE
    return raw[skip : skip + n]


def _frozen(arr: np.ndarray) -> memoryview:
    """A read-only view: bytes kept as checked are never written again."""
    arr.flags.writeable = False
    return memoryview(arr)


def _decode_layer(payload: memoryview, spec: LayerSpec, start: int) -> Optional[Layer]:
    if spec is None:
        return None
    if isinstance(spec, StateSpec):
        return StateLayer([None if a is None else a.load(payload) for a in spec.arrays])
    return KVLayer(spec.keys.load(payload), spec.values.load(payload), start + spec.row_offset, spec.window)


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
    if verify and xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise BlockDecodeError("payload checksum mismatch")
    block = Block(h.tokens.view(payload).copy(), [_decode_layer(payload, l, start) for l in h.layers])
    arrays = block_arrays(block)
    if arrays:
        mx.eval(arrays)  # copy out of the buffer now: it may be an mmap view that ends with its transaction
    return block


# -------------------------------------------------------------------- Stored


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
    def pack(cls, block: Block, key: bytes, start: int, backend: Optional[Backend] = None) -> "Stored":
        """``block`` serialized (its header is the one just written: no
        second parse); ``backend``: where its arrays live (default: ``choose()``)."""
        buf, header = _serialize(block, key, backend or choose())
        return cls(key, start, buf, header, True)

    @classmethod
    def pack_run(cls, whole: Block, first: Block, keys: list[bytes], starts: list[int],
                 backend: Optional[Backend] = None) -> Iterator["Stored"]:
        """The blocks of ``whole``'s rows laid out as ``first``, serialized together (``serialize_run``)."""
        for (buf, header), key, start in zip(serialize_run(whole, first, keys, backend), keys, starts):
            yield cls(key, start, buf, header, True)

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

    @cached_property
    def nbytes(self) -> int:
        return len(self.buf)

    @cached_property
    def tokens(self) -> np.ndarray:
        """(Cached: a RAM block is asked for its tokens and size by every fetch that finds it.)"""
        return self.header.tokens.view(self.payload)

    def intact(self) -> bool:
        """The payload checksum (xxh3 releases the GIL: threads hash side by side)."""
        return self.checked or xxhash.xxh3_64_intdigest(self.payload) == self.header.checksum

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
