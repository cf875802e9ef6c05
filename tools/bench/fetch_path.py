"""What one ``PrefixStore.fetch`` does on the engine's thread: the kvstore
modules it enters, how often control passes between them, and how often it
takes the package's own locks (issue 52's figures).

    kvstore bench fetch-path [--tokens 2048] [--layers 8] [--warmup 3] [--json] [--out FILE]

Public API only (``PrefixStore(ssd_path=..., block_size=256)``, ``put``,
``flush``, ``close``, ``fetch``), so it runs on any tree. Two fetches are
traced: a RAM hit, and a disk hit after ``flush``, ``close`` and reopening
the store. Warm-up fetches go first (of the same prompt for the RAM hit; of
other prompts stored alongside for the disk hit, since a disk hit promotes its
blocks to RAM), so one-time costs are not counted.

The trace is ``sys.setprofile`` on the calling thread only (other threads'
work, the writer's or a pool's, is not seen). A *kvstore frame* is one whose
module (``f_globals["__name__"]``) is ``kvstore`` or under it, but not under
``kvstore.adapters`` or ``kvstore.tools``. Definitions:

- **modules**: the distinct modules of kvstore frames that got a ``call``
  event (generator resumptions included).
- **transitions**: take the Python ``call`` and ``return`` events of kvstore
  frames in order (generator resumptions and yields included; events of other
  packages' frames, numpy, mlx, the standard library, are skipped); a
  transition is an event whose frame's module differs from that of the event
  before it in this sequence. A call from module A into B and back counts two
  (A -> B at B's call, B -> A at A's next event).
- **locks**: acquisitions whose caller frame (the frame making the call) is a
  kvstore frame: C calls of ``acquire`` / ``__enter__`` of a ``_thread.lock``
  or ``_thread.RLock``; ``__exit__`` of one where its ``__enter__`` was not seen
  (a ``with`` statement enters a C lock with no profile event, and leaves it
  with one); and Python calls of ``threading.Condition.__enter__`` /
  ``acquire`` / ``wait`` / ``wait_for`` and ``threading.Event.wait``. Locks the
  standard library takes for the store (a thread pool's ``submit``) are not the
  package's own and are not counted. Broken down by caller ``module:function``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from kvstore import KVLayer, PrefixStore

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
_LOCK_CALLS = ("acquire", "acquire_lock", "__enter__")
_PY_WAITS = {threading.Condition.__enter__.__code__: "Condition.__enter__",
             threading.Condition.wait.__code__: "Condition.wait",
             threading.Condition.wait_for.__code__: "Condition.wait_for",
             threading.Event.wait.__code__: "Event.wait"}


def store_module(frame) -> Optional[str]:
    """The kvstore module ``frame`` runs in, or None (other packages, adapters and tools)."""
    name = frame.f_globals.get("__name__", "")
    if name != "kvstore" and not name.startswith("kvstore."):
        return None
    if name.startswith(("kvstore.adapters", "kvstore.tools")):
        return None
    return name


class FetchTrace:
    """The profile hook: modules, transitions and lock acquisitions of one call."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.transitions = 0
        self.pairs: Counter[str] = Counter()  # "a -> b": where the transitions are
        self.locks: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self._last: Optional[str] = None  # the module of the last kvstore frame's call or return
        self._entered: set[tuple[int, int]] = set()  # (frame, lock) pairs whose __enter__ was seen

    def _event(self, module: str) -> None:
        if self._last is not None and module != self._last:
            self.transitions += 1
            self.pairs[f"{self._last} -> {module}"] += 1
        self._last = module

    def _lock(self, frame, kind: str) -> None:
        self.locks[f"{store_module(frame)}:{frame.f_code.co_qualname}"] += 1
        self.kinds[kind] += 1

    def __call__(self, frame, event: str, arg) -> None:
        if event == "call":
            module = store_module(frame)
            if module is not None:
                self.modules.add(module)
                self._event(module)
            kind = _PY_WAITS.get(frame.f_code)
            if kind is not None and store_module(frame.f_back) is not None:
                self._lock(frame.f_back, kind)
        elif event == "return":
            if (module := store_module(frame)) is not None:
                self._event(module)
        elif event == "c_call" and isinstance(getattr(arg, "__self__", None), _LOCK_TYPES):
            if store_module(frame) is None:
                return
            key = (id(frame), id(arg.__self__))
            if arg.__name__ in _LOCK_CALLS:
                if arg.__name__ == "__enter__":
                    self._entered.add(key)
                self._lock(frame, type(arg.__self__).__name__)
            elif arg.__name__ == "__exit__":
                if key in self._entered:
                    self._entered.discard(key)
                else:
                    self._lock(frame, type(arg.__self__).__name__)

    def report(self) -> dict[str, Any]:
        return {"modules": sorted(self.modules), "module_count": len(self.modules),
                "transitions": self.transitions, "transitions_by_pair": dict(self.pairs.most_common()),
                "lock_acquisitions": sum(self.locks.values()),
                "locks_by_caller": dict(self.locks.most_common()), "locks_by_kind": dict(self.kinds)}


def trace(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``fn()`` run under a ``FetchTrace`` on this thread: its result and the trace's report."""
    t = FetchTrace()
    sys.setprofile(t)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, t.report()


def _layers(rng: np.random.Generator, layers: int, heads: int, dim: int, tokens: int) -> list[KVLayer]:
    import mlx.core as mx

    def one():
        return mx.array(rng.standard_normal((1, heads, tokens, dim), dtype=np.float32).astype(np.float16))

    out = [KVLayer(one(), one()) for _ in range(layers)]
    mx.eval([x for layer in out for x in (layer.keys, layer.values)])
    return out


def _traced_fetch(store: PrefixStore, toks: np.ndarray) -> dict[str, Any]:
    hit, rep = trace(lambda: store.fetch("fetch-path", toks))
    rep["hit"] = {"length": hit.length, "ram_tokens": hit.ram_tokens, "ssd_tokens": hit.ssd_tokens}
    return rep


def run(tokens: int, layers: int, heads: int, dim: int, warmup: int, folder: Path) -> dict[str, Any]:
    """Issue 52's two fetches traced: ``{"ram_hit": report, "disk_hit": report, "setup": ...}``."""
    rng = np.random.default_rng(52)
    prompts = [rng.integers(5, 30_000, tokens).astype(np.int32) for _ in range(warmup + 1)]
    kv = _layers(rng, layers, heads, dim, tokens)  # the rows need not fit the tokens: one set serves every prompt
    path = folder / "fetch-path.lmdb"
    store = PrefixStore(ssd_path=str(path), block_size=256)
    for toks in prompts:
        store.put("fetch-path", toks, kv)
    store.flush()
    measured = prompts[-1]
    for _ in range(warmup):
        store.fetch("fetch-path", measured)
    out: dict[str, Any] = {"ram_hit": _traced_fetch(store, measured)}
    store.close()
    store = PrefixStore(ssd_path=str(path), block_size=256)
    for toks in prompts[:-1]:  # disk hits of other prompts: the measured one's blocks stay on disk alone
        store.fetch("fetch-path", toks)
    store.flush()
    out["disk_hit"] = _traced_fetch(store, measured)
    store.close()
    out["setup"] = {"tokens": tokens, "layers": layers, "heads": heads, "dim": dim, "block_size": 256,
                    "warmup_fetches": warmup, "python": sys.version.split()[0]}
    return out


def _table(res: dict[str, Any]) -> str:
    rows = ["| on the engine's thread, one fetch | RAM hit | disk hit |", "|---|---|---|"]
    ram, disk = res["ram_hit"], res["disk_hit"]
    for label, key in (("kvstore modules entered", "module_count"), ("module-to-module transitions", "transitions"),
                       ("acquisitions of the package's own locks", "lock_acquisitions")):
        rows.append(f"| {label} | {ram[key]} | {disk[key]} |")
    for name, rep in (("RAM hit", ram), ("disk hit", disk)):
        rows.append(f"\n{name} ({rep['hit']}): modules {', '.join(rep['modules'])}")
        rows += [f"  {n:3d}  {site}" for site, n in rep["locks_by_caller"].items()]
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench fetch-path", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    ap.add_argument("--heads", type=int, default=2, help="KV heads (default 2)")
    ap.add_argument("--dim", type=int, default=64, help="head dim (default 64)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up fetches before each traced one (default 3)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ap.add_argument("--out", type=Path, help="also write the JSON report to this file")
    args = ap.parse_args(argv)
    if args.tokens < 256 or args.layers < 1 or args.warmup < 1:
        ap.error("--tokens must be at least 256 (one block), --layers and --warmup at least 1")
    with tempfile.TemporaryDirectory(prefix="kvstore-fetch-path-") as d:
        res = run(args.tokens, args.layers, args.heads, args.dim, args.warmup, Path(d))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1) if args.json else _table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
