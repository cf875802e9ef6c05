"""``kvstore run``'s bootstrap (on $PYTHONPATH of the engine it starts):
instruments mlx-lm when it is imported (kvstore.adapters.run), then runs the
sitecustomize module this one shadows, if there is one."""

import os
import sys

if os.environ.get("KVSTORE_RUN_STORE") is not None:
    try:
        from kvstore.adapters.run import install_hook

        install_hook()
    except Exception as e:  # e.g. an interpreter without kvstore installed
        sys.stderr.write(f"kvstore run: the store is off in this process ({sys.executable}): {e}\n")


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_chain()
