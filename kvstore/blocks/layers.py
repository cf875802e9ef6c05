"""The per-layer arrays the store speaks: what adapters hand in and get back.

The store never sees engine cache classes. An adapter flattens an engine's
prompt cache into one entry per layer:

- ``KVLayer``: attention keys and values whose token axis is -2
  (``[batch, heads, tokens, head_dim]``). Rows cover tokens
  ``[start, start + T)``. The store cuts them into blocks, so any prefix can be
  served. ``window`` marks a sliding-window layer: restoring at length ``L``
  needs only rows ``[max(0, L - window), L)``.
- ``StateLayer``: a recurrent state (SSM, linear attention) that is valid only
  at the exact token position where it was taken. The store keeps it with the
  block that ends there and never serves a length where it is missing.

A tensor is either a dense ``mx.array`` or a ``Quantized`` triple as
``mx.quantize`` returns it (of rotated rows, when ``rotation`` is set:
``dequantize`` undoes it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..errors import LayoutError
from .rotation import unrotate


@dataclass(frozen=True)
class Quantized:
    """``mx.quantize`` output plus the settings needed to undo it.

    ``rotation``: the seed of the orthogonal rotation (``kvstore.blocks.rotation``)
    the rows were quantized under, ``None`` for plain rows. Code that builds a
    ``Quantized`` from another one's arrays keeps it with ``with_arrays``.
    """

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    rotation: Optional[int] = None

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape."""
        *lead, packed = self.data.shape
        return (*lead, packed * 32 // self.bits)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + self.biases.nbytes

    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.data, self.scales, self.biases

    @property
    def settings(self) -> tuple[int, int, Optional[int]]:
        """(bits, group size, rotation): tensors that share them concatenate as they are."""
        return self.bits, self.group_size, self.rotation

    def dequantize(self) -> mx.array:
        x = dequantize(self.data, self.scales, self.biases, self.group_size, self.bits)
        return x if self.rotation is None else unrotate(x, self.rotation)

    def with_arrays(self, data: mx.array, scales: mx.array, biases: mx.array) -> "Quantized":
        """Other arrays (a slice, a copy, a concatenation) under the same settings."""
        return replace(self, data=data, scales=scales, biases=biases)

    def take(self, start: int, stop: int) -> "Quantized":
        """Rows ``[start, stop)`` of the token axis (-2)."""
        return self.with_arrays(*(take_rows(a, start, stop) for a in self.arrays()))


Tensor = Union[mx.array, Quantized]


def dequantize(data: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize``, bit for bit, about twice as fast on the CPU.

    mlx's CPU kernel computes ``scale * q + bias`` in half precision and is the
    bottleneck of serving quantized entries to a dense engine there (~0.2 GB/s
    of fp16 on these machines). For 2, 4 and 8 bits the packed values are whole
    bytes or nibbles: unpack them with byte ops and do the arithmetic in fp32,
    rounding to the half type after the product and after the sum exactly
    where the half-precision kernel rounds. GPUs keep mlx's fused kernel.
    """
    if bits not in (2, 4, 8) or mx.default_device() != mx.cpu or scales.dtype == mx.float32:
        return mx.dequantize(data, scales, biases, group_size=group_size, bits=bits)
    b = data.view(mx.uint8)
    if bits == 4:
        b = mx.stack([b & 0xF, b >> 4], axis=-1)
    elif bits == 2:
        b = mx.stack([b & 3, (b >> 2) & 3, (b >> 4) & 3, b >> 6], axis=-1)
    v = b.reshape(*scales.shape, group_size).astype(mx.float32)
    f32 = mx.float32
    m = (v * scales[..., None].astype(f32)).astype(scales.dtype).astype(f32)
    return (m + biases[..., None].astype(f32)).astype(scales.dtype).reshape(*data.shape[:-1], -1)


def tensor_arrays(t: Tensor) -> tuple[mx.array, ...]:
    """A tensor's arrays: its own, or a quantized one's data, scales and biases."""
    return t.arrays() if isinstance(t, Quantized) else (t,)


def tensor_rows(t: Tensor) -> int:
    """Number of tokens (axis -2) a tensor holds."""
    return t.shape[-2]


def take_rows(t: Tensor, start: int, stop: int) -> Tensor:
    """Rows ``[start, stop)`` of the token axis (-2), as a view."""
    if isinstance(t, Quantized):
        return t.take(start, stop)
    # (mlx parses an index with an Ellipsis several times slower than plain slices: a put and a hit
    # cut every layer's arrays, so a 4-D tensor, what every KV layer holds, is cut without one)
    return t[:, :, start:stop] if t.ndim == 4 else t[..., start:stop, :]


def own(t: Tensor) -> Tensor:
    """A copy that owns its memory: a slice (a view) would keep the engine's
    whole buffer alive, and an alias would see the engine's in-place writes."""
    if isinstance(t, Quantized):
        return t.with_arrays(*(mx.contiguous(a) for a in t.arrays()))
    return mx.contiguous(t)


@dataclass
class KVLayer:
    """Keys and values of one attention layer for tokens ``[start, stop)``.

    ``rows``: how many rows, from the first, hold those tokens, for arrays
    with room after them (an engine's buffer, as mlx-lm's ``KVCache`` grows
    it): such a buffer is stored as it is, with no slice to build and
    evaluate, and its spare rows are never read. ``None``: every row.
    """

    keys: Tensor
    values: Tensor
    start: int = 0
    window: Optional[int] = None
    rows: Optional[int] = None

    @classmethod
    def many(cls, pairs: Iterable[tuple[Tensor, Tensor]]) -> list["KVLayer"]:
        """A layer of each (keys, values) pair, rows from 0 (a hit's layers at once)."""
        return [cls(k, v) for k, v in pairs]

    @property
    def stop(self) -> int:
        return self.start + (tensor_rows(self.keys) if self.rows is None else self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's rows (spare rows not counted)."""
        n = self.keys.nbytes + self.values.nbytes
        return n if self.rows is None else n * self.rows // max(1, tensor_rows(self.keys))


@dataclass
class StateLayer:
    """A recurrent state snapshot, valid only at one token position.

    ``arrays`` may hold ``None`` entries (an engine slot not yet filled).
    """

    arrays: list[Optional[mx.array]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


Layer = Union[KVLayer, StateLayer]


WARM_LAYERS = 64  # layers of a put path's warm-up: as many as most models have (one of a few warmed far less)

KV_DTYPES = (mx.float16, mx.bfloat16, mx.float32)  # what dense keys and values may be (quantizable, stored exactly)
STATE_DTYPES = KV_DTYPES + (mx.int8, mx.uint8, mx.int32, mx.uint32, mx.int64)  # a recurrent state's slots
_NUMPY = {np.dtype(np.float16): mx.float16, np.dtype(np.float32): mx.float32, np.dtype(np.int8): mx.int8,
          np.dtype(np.uint8): mx.uint8, np.dtype(np.int32): mx.int32, np.dtype(np.uint32): mx.uint32,
          np.dtype(np.int64): mx.int64}


def _names(dtypes) -> str:
    return ", ".join(str(d).split(".")[-1] for d in dtypes)


def _captured(a, i: int, part: str, dtypes: tuple) -> mx.array:
    """``a`` as a new mlx array object on the same data (no copy), or a numpy
    array copied into one; ``LayoutError`` for anything else, or a dtype the
    store cannot keep exactly (``part`` of layer ``i``)."""
    if isinstance(a, mx.array) and a.dtype in dtypes:
        return a[...]
    what = f"layer {i} {part}"
    if isinstance(a, np.ndarray):
        dtype = _NUMPY.get(a.dtype)
        if dtype is None or dtype not in dtypes:
            raise LayoutError(f"{what}: a numpy array of {a.dtype} cannot be stored exactly (use {_names(dtypes)})")
        return mx.array(a)
    if not isinstance(a, mx.array):
        raise LayoutError(f"{what}: expected an mlx array, got {type(a).__name__}")
    raise LayoutError(f"{what}: {str(a.dtype).split('.')[-1]} cannot be stored (use {_names(dtypes)})")


def _captured_tensor(t, i: int, part: str) -> Tensor:
    if isinstance(t, Quantized):
        return t.with_arrays(_captured(t.data, i, part + " data", (mx.uint32,)),
                             *(_captured(a, i, part + " scales/biases", KV_DTYPES) for a in (t.scales, t.biases)))
    return _captured(t, i, part, KV_DTYPES)


def captured_layers(layers: Sequence[Layer], n: int) -> list[Layer]:
    """``layers`` as ``put`` keeps them: checked against a prompt of ``n``
    tokens (``LayoutError`` otherwise), as new layer objects on new array
    objects over the same data. mlx's slice assignment (``a[...] = x``, how
    mlx-lm's ``KVCache`` writes into its buffers) rebinds the array object it
    is applied to, so views taken here keep the values of the moment of the
    ``put``, at no copy, however the caller changes its arrays or layers
    before the background write. numpy arrays of a dtype the store keeps
    exactly are copied into mlx arrays."""
    if not isinstance(layers, (list, tuple)) or not layers:
        raise LayoutError("layers must be a non-empty list of KVLayer / StateLayer")
    out: list[Layer] = []
    for i, l in enumerate(layers):
        if isinstance(l, KVLayer):
            out.append(KVLayer(_captured_tensor(l.keys, i, "keys"),  # (not replace(): 5x its cost)
                               _captured_tensor(l.values, i, "values"), l.start, l.window, l.rows))
        elif isinstance(l, StateLayer):
            if not isinstance(l.arrays, (list, tuple)):
                raise LayoutError(f"layer {i}: StateLayer.arrays must be a list of arrays (or None)")
            out.append(StateLayer([None if a is None else _captured(a, i, "state", STATE_DTYPES)
                                   for a in l.arrays]))
        else:
            raise LayoutError(f"layer {i}: expected KVLayer or StateLayer, got {type(l).__name__}")
    check_layers(out, n)
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_layers(layers: Sequence[Layer], n: int) -> None:
    """Raise ``LayoutError`` unless ``layers`` fit a prompt of ``n`` tokens
    (what ``PrefixStore.put`` accepts)."""
    if not isinstance(layers, (list, tuple)) or not layers:
        raise LayoutError("layers must be a non-empty list of KVLayer / StateLayer")
    for i, l in enumerate(layers):
        if isinstance(l, KVLayer):
            if not (_is_int(l.start) and (l.window is None or _is_int(l.window))
                    and (l.rows is None or _is_int(l.rows))):
                raise LayoutError(f"layer {i}: start must be an int, window and rows an int or None")
            ks, vs = l.keys.shape, l.values.shape
            if len(ks) != 4 or len(vs) != 4:
                raise LayoutError(f"layer {i}: keys/values must be [batch, heads, tokens, dim], got {ks} and {vs}")
            if ks[0] != 1 or ks[:3] != vs[:3]:
                raise LayoutError(f"layer {i}: keys {ks} and values {vs} must share batch (1), heads and tokens")
            if l.rows is not None and not 0 <= l.rows <= ks[2]:
                raise LayoutError(f"layer {i}: rows={l.rows} but the arrays hold {ks[2]} rows")
            if l.stop != n:
                raise LayoutError(f"layer {i}: rows cover tokens [{l.start}, {l.stop}) but the prompt has {n} tokens")
            if l.start < 0 or l.start > n:
                raise LayoutError(f"layer {i}: start {l.start} outside [0, {n}]")
        elif not isinstance(l, StateLayer):
            raise LayoutError(f"layer {i}: expected KVLayer or StateLayer, got {type(l).__name__}")
