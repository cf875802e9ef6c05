"""Engine adapters (installed as ``kvstore.adapters``): translate an engine's
own prompt-cache objects to and from the per-layer arrays of
:mod:`kvstore.blocks.layers`.

This folder lives outside ``kvstore/`` on purpose: the store never imports an
engine's cache classes, so each engine gets a module here
(``kvstore.adapters.mlx_lm``) that is the only place both worlds meet.
"""
