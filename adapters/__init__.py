"""Engine adapters: translate an engine's own prompt-cache objects to and from
the per-layer arrays of :mod:`kvstore.layers`.

Adapters live outside ``kvstore/`` on purpose: the store must never import an
engine's cache classes, so each engine gets a module here (``adapters.mlx_lm``)
that is the only place both worlds meet.
"""
