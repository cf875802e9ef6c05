"""``python -m kvstore``: the ``kvstore`` command. The engine commands (demo,
serve, generate, ...) are kvstore.adapters', added where mlx-lm is installed
(imported by name: the core imports no adapter); the store commands work
without it."""

import importlib

from .admin.cli import main

try:
    importlib.import_module("kvstore.adapters.cli")  # registers its commands on the same app
except ModuleNotFoundError as e:
    if e.name not in ("mlx", "mlx_lm"):
        raise

main()
