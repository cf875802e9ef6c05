"""How a store keeps KV (``Codec``: dense or quantized, rotated or not),
and ``Block``, one block of KV in memory. Its bytes are ``kvstore.blocks.wire``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import mlx.core as mx
import numpy as np

from ..errors import ConfigError
from .hashing import narrowest
from .layers import KVLayer, Layer, Quantized, StateLayer, Tensor, tensor_arrays
from .rotation import DEFAULT_SEED, rotatable, rotate

if TYPE_CHECKING:
    from ..config import StoreConfig

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
ROTATE_AT_OR_BELOW = 4  # default bits at or below which keys and values are rotated (``StoreConfig`` says why)


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
        """(how KV is kept, e.g. "K8/V4 g64" or "dense", and its dtype); layers kept in several ways are
        listed in order of appearance, e.g. "K8/V8 g64 + dense" (``Codec.full_attention``)."""
        kvs = [l for l in self.layers if isinstance(l, KVLayer)]
        if not kvs:
            return "state only", "-"
        kinds = list(dict.fromkeys(_describe_layer(l) for l in kvs))
        return " + ".join(kinds), str(kvs[0].keys.dtype).split(".")[-1]


def _describe_layer(kv: KVLayer) -> str:
    k, v = kv.keys, kv.values
    if not isinstance(k, Quantized) and not isinstance(v, Quantized):
        return "dense"
    kb = f"K{k.bits}{'r' if k.rotation is not None else ''}" if isinstance(k, Quantized) else "K16"
    vb = f"V{v.bits}{'r' if v.rotation is not None else ''}" if isinstance(v, Quantized) else "V16"
    g = k.group_size if isinstance(k, Quantized) else v.group_size
    return f"{kb}/{vb} g{g}"


# ----------------------------------------------------------------- compression


def _fit_group(dim: int, group_size: int) -> Optional[int]:
    """Largest supported group size <= ``group_size`` dividing ``dim``."""
    for g in sorted((g for g in GROUP_SIZES if g <= group_size), reverse=True):
        if dim % g == 0:
            return g
    return None


def _default_rotation(bits: Optional[int], limit: Optional[int]) -> bool:
    return bits is not None and limit is not None and bits <= limit


SAME = "same"  # ``full_attention_bits``: full-attention layers kept as every other layer


def _bits_pair(kv_bits, name: str) -> tuple[Optional[int], Optional[int]]:
    if kv_bits is None or isinstance(kv_bits, int) and not isinstance(kv_bits, bool):
        pair = (kv_bits, kv_bits)
    elif isinstance(kv_bits, tuple) and len(kv_bits) == 2 and all(
            b is None or isinstance(b, int) and not isinstance(b, bool) for b in kv_bits):
        pair = kv_bits
    else:
        pair = None
    if pair is not None and all(b is None or b in BITS for b in pair):
        return pair
    raise ConfigError(f"{name} must be None, an int of {BITS} or a pair (key_bits, value_bits), got {kv_bits!r}")


@dataclass(frozen=True)
class Codec:
    """How a store keeps KV: ``None`` bits keep the engine's dtype as given,
    otherwise ``mx.quantize`` with that many bits (keys and values separately).
    ``rotate_keys`` rotates keys by ``kvstore.blocks.rotation``'s fixed Hadamard
    transform before quantizing them (undone on restore): outlier channels
    then spread over their group instead of setting its scale.
    ``rotate_values`` does the same to values (attention output is linear in
    V, so ``V = V' R`` on restore is exact up to quantization).
    ``full_attention``: how the full-attention layers of a model that also has
    sliding-window layers are kept (Gemma 3's global layers), ``None``: as
    the others. Such layers are few and each reaches back over the whole
    prompt: on Gemma 3 270M their q8 error cost more top-1 agreement than
    that of all its 15 windowed layers (docs/benchmarks.md). Each layer's
    tensors record their own settings in the block header, so blocks mixing
    them need no other format and are read back as kept."""

    key_bits: Optional[int] = None
    value_bits: Optional[int] = None
    group_size: int = 64
    rotate_keys: bool = False
    rotate_values: bool = False
    full_attention: Optional["Codec"] = None

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
        if self.full_attention is not None and self.full_attention.full_attention is not None:
            raise ConfigError("full_attention is one level deep")

    @classmethod
    def from_bits(cls, kv_bits: Union[None, int, tuple], group_size: int = 64,
                  rotate_keys: Optional[bool] = None, rotate_values: Optional[bool] = None,
                  rotate_keys_at_or_below: Optional[int] = ROTATE_AT_OR_BELOW,
                  rotate_values_at_or_below: Optional[int] = ROTATE_AT_OR_BELOW,
                  full_attention_bits: Union[None, int, tuple, str] = SAME) -> "Codec":
        """``kv_bits``: an int for both, or ``(key_bits, value_bits)``.
        ``rotate_keys=None`` rotates keys of ``rotate_keys_at_or_below`` bits or fewer,
        ``rotate_values=None`` values of ``rotate_values_at_or_below`` bits or fewer
        (``StoreConfig`` says why). ``full_attention_bits`` (spelled as ``kv_bits``;
        ``"same"``: ``kv_bits``) for the full-attention layers of a model that also has
        sliding-window layers, with the same group size and rotation choices (an explicit
        rotation applies where its bits quantize)."""
        k, v = _bits_pair(kv_bits, "kv_bits")
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ConfigError(f"kv_group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        for name, r in (("rotate_keys", rotate_keys), ("rotate_values", rotate_values)):
            if r is not None and not isinstance(r, bool):
                raise ConfigError(f"{name} must be True, False or None, got {r!r}")
        full = None
        if not (isinstance(full_attention_bits, str) and full_attention_bits == SAME):
            fk, fv = _bits_pair(full_attention_bits, "full_attention_bits")
            full = cls.from_bits((fk, fv), group_size, rotate_keys if fk is not None else False,
                                 rotate_values if fv is not None else False, rotate_keys_at_or_below,
                                 rotate_values_at_or_below)
        if rotate_keys is None:
            rotate_keys = _default_rotation(k, rotate_keys_at_or_below)
        if rotate_values is None:
            rotate_values = _default_rotation(v, rotate_values_at_or_below)
        return cls(k, v, group_size, bool(rotate_keys), bool(rotate_values), full)

    @classmethod
    def of(cls, cfg: "StoreConfig") -> "Codec":
        """The codec a store of ``cfg`` stores with (``ConfigError`` for bits or a group size it cannot use)."""
        return cls.from_bits(cfg.kv_bits, cfg.kv_group_size, cfg.rotate_keys, cfg.rotate_values,
                             cfg.tuning.rotate_keys_at_or_below, cfg.tuning.rotate_values_at_or_below,
                             cfg.full_attention_bits)

    def for_layer(self, window: Optional[int], windowed_model: bool) -> "Codec":
        """The codec of one layer: ``full_attention`` for a full-attention layer (``window`` None) of a
        model with sliding-window layers (``windowed_model``), this one otherwise."""
        if self.full_attention is not None and window is None and windowed_model:
            return self.full_attention
        return self

    def compress_keys(self, t: Tensor) -> Tensor:
        return convert(t, self.key_bits, self.group_size, DEFAULT_SEED if self.rotate_keys else None)

    def compress_values(self, t: Tensor) -> Tensor:
        return convert(t, self.value_bits, self.group_size, DEFAULT_SEED if self.rotate_values else None)

    def describe(self) -> str:
        if self.key_bits is None and self.value_bits is None:
            out = "as given"
        else:
            out = (f"K{self.key_bits or 16}{'r' if self.rotate_keys else ''}/"
                   f"V{self.value_bits or 16}{'r' if self.rotate_values else ''} g{self.group_size}")
        if self.full_attention is not None:
            out += f"; full-attention layers of windowed models: {self.full_attention.describe()}"
        return out


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


def layer_arrays(layer: Layer) -> list[mx.array]:
    """Every mlx array a layer holds (state slots left empty skipped)."""
    if isinstance(layer, StateLayer):
        return [a for a in layer.arrays if a is not None]
    out = []
    for t in (layer.keys, layer.values):
        out.extend(tensor_arrays(t))
    return out


def block_arrays(block: Block) -> list[mx.array]:
    """Every mlx array a block holds (to evaluate them in one call)."""
    return [a for l in block.layers if l is not None for a in layer_arrays(l)]
