"""Deterministic KV for tests: row ``p`` of every array is a function of the
prompt prefix ``tokens[:p + 1]`` (as a real model's KV is), so the expected KV
of any prefix is known without a model, and KV served for the wrong prefix
cannot pass for the right one."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from contextlib import contextmanager
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import msgpack
import pytest
import numpy as np
import xxhash
from mlx.utils import tree_map

from kvstore.blocks import header as wire_header
from kvstore.blocks.codec import Block
from kvstore.blocks.wire import serialize
from kvstore.blocks.hashing import as_tokens
from kvstore.blocks.layers import KVLayer, Quantized, StateLayer
from kvstore.tiers.disk.lmdb import LmdbTier

_P = (1 << 31) - 1

# the installed mlx-lm as (major, minor): CI runs the suite on 0.32 and, in its vllm-mlx lane, on 0.31
MLX_LM = tuple(int(x) for x in metadata.version("mlx-lm").split(".")[:2])


def keys_and_values(cache) -> tuple:
    """An mlx-lm KV cache's keys and values cut to its offset (0.32's
    ``keys_and_values()``; 0.31 has no such method)."""
    if hasattr(cache, "keys_and_values"):
        return cache.keys_and_values()
    return tree_map(lambda x: x[..., : cache.offset, :], (cache.keys, cache.values))


def prefix_seeds(tokens: Sequence[int], salt: int) -> np.ndarray:
    """One seed per position, chained over the prefix."""
    out = np.empty(len(tokens), dtype=np.int64)
    s = (salt * 2654435761 + 12345) % _P
    for i, t in enumerate(tokens):
        s = (s * 1000003 + int(t) + 1) % _P
        out[i] = s
    return out


def rows(tokens: Sequence[int], salt: int, heads: int = 1, dim: int = 32, dtype=mx.float16) -> mx.array:
    """``[1, heads, len(tokens), dim]`` values in [-2, 2) derived from each prefix."""
    seeds = prefix_seeds(tokens, salt)
    mult = np.arange(heads * dim, dtype=np.int64) * 7919 + 104729
    v = ((seeds[:, None] * mult[None, :]) % 65521).astype(np.float32) / 16384.0 - 2.0
    v = v.reshape(len(tokens), heads, dim).transpose(1, 0, 2)[None]
    return mx.array(np.ascontiguousarray(v)).astype(dtype)


def kv_layers(tokens: Sequence[int], n_layers: int = 2, heads: int = 1, dim: int = 32,
              dtype=mx.float16) -> list[KVLayer]:
    """The KV a model would hold after ``tokens``: rows ``[0, len(tokens))`` per layer."""
    return [KVLayer(rows(tokens, 2 * li, heads, dim, dtype), rows(tokens, 2 * li + 1, heads, dim, dtype))
            for li in range(n_layers)]


def state_at(tokens: Sequence[int]) -> StateLayer:
    """A recurrent-state snapshot taken after ``tokens`` (one slot left empty)."""
    seed = int(prefix_seeds(tokens, 99)[-1]) if len(tokens) else 7
    a = mx.array(np.full((1, 2, 4), seed % 1000, dtype=np.float32) / 7.0)
    return StateLayer([a, None])


def dq(x: mx.array, bits: int, group_size: int) -> mx.array:
    """What ``bits``-bit storage of ``x`` gives back."""
    return mx.dequantize(*mx.quantize(x, group_size=group_size, bits=bits), group_size=group_size, bits=bits)


def bits_of(a: mx.array) -> np.ndarray:
    """Raw bit pattern of an array (exact comparison, NaN included)."""
    view = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}[a.dtype.size]
    return np.asarray(a.view(view))


def same(a, b) -> bool:
    """Bit-exact equality of two tensors (dense or ``Quantized``), dtype and shape included."""
    if isinstance(a, Quantized) or isinstance(b, Quantized):
        return (isinstance(a, Quantized) and isinstance(b, Quantized) and (a.bits, a.group_size) == (b.bits, b.group_size)
                and all(same(x, y) for x, y in zip(a.arrays(), b.arrays())))
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits_of(a), bits_of(b))


def expected_layers(tokens: Sequence[int], length: int, kv_bits: Optional[int] = None,
                    group_size: int = 32, **kw) -> list[mx.array]:
    """Per layer (keys, values) the store must serve for ``tokens[:length]``."""
    out = []
    for l in kv_layers(list(tokens[:length]), **kw):
        k, v = l.keys, l.values
        if kv_bits is not None:
            k, v = dq(k, kv_bits, group_size), dq(v, kv_bits, group_size)
        out.append((k, v))
    return out


def assert_hit_is(hit, tokens: Sequence[int], length: int, kv_bits: Optional[int] = None, **kw) -> None:
    """``hit`` serves exactly ``tokens[:length]`` with its KV (bit-exact)."""
    assert hit.length == length, f"hit of {hit.length} tokens, expected {length}"
    if length == 0:
        assert hit.layers is None
        return
    assert hit.ram_tokens + hit.ssd_tokens + hit.remote_tokens == length
    exp = expected_layers(tokens, length, kv_bits, **kw)
    assert len(hit.layers) == len(exp)
    for li, (layer, (k, v)) in enumerate(zip(hit.layers, exp)):
        assert isinstance(layer, KVLayer)
        assert layer.start == 0 and layer.stop == length, (li, layer.start, layer.stop)
        assert same(layer.keys, k), f"layer {li}: keys differ from the KV of tokens[:{length}]"
        assert same(layer.values, v), f"layer {li}: values differ from the KV of tokens[:{length}]"


def wire_prefix(header: bytes, version: int = wire_header.FORMAT_VERSION) -> bytes:
    """A block's prefix as the format spells it: magic, version, reserved 0,
    header length, xxh3_64 of the header."""
    return struct.pack("<4sHHIQ", wire_header.MAGIC, version, 0, len(header), xxhash.xxh3_64_intdigest(header))


def raw_header(buf) -> dict:
    """A block's msgpack header as the plain map on the wire (to forge
    headers kvstore's writer never writes)."""
    hlen = int.from_bytes(bytes(buf[8:12]), "little")
    return msgpack.unpackb(bytes(buf[20 : 20 + hlen]), raw=False)


def repack(buf, fields, version: int = wire_header.FORMAT_VERSION) -> bytes:
    """``buf``'s payload under a new header, with valid checksums: a hostile
    writer, not random corruption."""
    h = wire_header.read_header(buf)
    header = msgpack.packb(fields, use_bin_type=True)
    head = wire_prefix(header, version) + header
    return head + bytes(-len(head) % wire_header.ALIGN) + bytes(memoryview(buf)[h.payload_start:])


# ---------------------------------------------- a store of 8-token blocks

BS = 8
M = "test-model"


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def put(store, p, **kw):
    return store.put(M, p, kv_layers(p, **kw))


# what one block costs in RAM: its serialized bytes (2 layers x (K, V) of [1, 1, 8, 32] float16, its
# tokens, the header, 64-byte alignment), the same bytes the disk tier stores
BLOCK_BYTES = len(serialize(Block(as_tokens(toks(BS)), kv_layers(toks(BS))), b"k" * 16))  # (a key: 16 bytes)


def block_by_block(monkeypatch) -> None:
    """The writer encodes each block by itself, as it does on the CPU (on CUDA it encodes runs of blocks at
    once): for tests that watch, or stop, the writer between one block's encoding and the next."""
    import kvstore.convert.encode as encoding
    import kvstore.flow.writer as writer

    monkeypatch.setattr(writer, "encoded", partial(encoding.encoded, together=False))


@contextmanager
def lmdb_of(path) -> Iterator[LmdbTier]:
    """The LMDB tier at ``path``, opened read-only on its own (public
    ``LmdbTier``: ``env``, ``dbs``, ``models()``, ...): for a store already
    closed, since one process must not open the same environment twice."""
    disk = LmdbTier(path, readonly=True)
    try:
        yield disk
    finally:
        disk.close()


def blocks_on_disk(path) -> dict[bytes, bytes]:
    """Every block's stored value in the closed store at ``path``, by key."""
    with lmdb_of(path) as disk, disk.env.begin(db=disk.dbs[b"blocks"]) as txn:
        return {bytes(k): bytes(v) for k, v in txn.cursor()}


def flip_a_byte(path, key: bytes) -> None:
    """Flip a byte near the end of the block ``key``'s stored value in the closed store at ``path`` (its
    payload: the block fails its checksum when read)."""
    import lmdb

    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            blocks = env.open_db(b"blocks", txn=txn, create=False)
            value = bytearray(txn.get(key, db=blocks))
            value[-3] ^= 0xFF
            txn.put(key, bytes(value), db=blocks)
    finally:
        env.close()


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``folder``: a device that fills up for real (needs Linux, root and mount
    rights; the test is skipped otherwise)."""
    folder.mkdir()
    if sys.platform != "linux" or shutil.which("mount") is None:
        pytest.skip("needs Linux and mount(8) for a tmpfs")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
