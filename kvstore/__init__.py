"""kvstore: a tiered, persistent prefix KV cache for mlx-lm engines."""

from .gpu.mlx_env import keep_new_shapes_alive

keep_new_shapes_alive()  # before mlx loads: on CUDA, new prompt shapes must not end the process (kvstore.gpu.mlx_env)

from .blocks.codec import Codec
from .errors import (BlockDecodeError, ConfigError, InputError, KVStoreError, LayoutError, ReadOnlyError, RemoteConfigError,
                     StorageError, StoreClosedError, StoreOpenError, TransferError)
from .blocks.layers import KVLayer, Layer, Quantized, StateLayer
from .store import Hit, PrefixStore

__all__ = ["PrefixStore", "Hit", "KVLayer", "StateLayer", "Quantized", "Layer", "Codec",
           "KVStoreError", "InputError", "StoreOpenError", "BlockDecodeError", "LayoutError", "ConfigError", "StoreClosedError",
           "ReadOnlyError", "StorageError", "RemoteConfigError", "TransferError"]
__version__ = "0.1.0"
