"""Run mlx-lm's own ``tests/test_server.py`` with its ``LRUPromptCache`` and
with the store's ``StorePromptCache`` in its place, and compare.

mlx-lm's test file is not in its wheel: give the folder of its source
(``pip download --no-deps --no-binary :all: mlx-lm==VERSION`` and unpack it).
The file is used unchanged but for two substitutions made in a copy: the
hub model it loads (no network here) becomes a tiny local model, and each
``LRUPromptCache(...)`` becomes ``StorePromptCache`` on a new RAM store
(``--cache store``; the cache learns its model provider when mlx-lm's
``ResponseGenerator`` is built on it). Needs ``requests`` (mlx-lm's tests use it).

    python tools/mlx_lm_server_tests.py ~/src/mlx_lm-0.32.2 [--runs 20] [-k quantizes]

docs/mlx-lm-server-tests.md lists the tests the store fails by design, and why.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HUB_MODEL = "mlx-community/Qwen1.5-0.5B-Chat-4bit"

PRELUDE = '''
import mlx_lm.server as _S
from kvstore import PrefixStore as _PrefixStore
from kvstore.adapters.server import StorePromptCache as _StorePromptCache


def _store_cache(*args, **kwargs):
    """A StorePromptCache on a new RAM store, in LRUPromptCache's place."""
    return _StorePromptCache(_PrefixStore(budget_gb=1, block_size={block}), None)


_init = _S.ResponseGenerator.__init__


def _bind(self, model_provider, prompt_cache, *args, **kwargs):
    if isinstance(prompt_cache, _StorePromptCache) and prompt_cache.provider is None:
        prompt_cache.provider = model_provider
    _init(self, model_provider, prompt_cache, *args, **kwargs)


_S.ResponseGenerator.__init__ = _bind
'''


def prepare(source: Path, model: Path, cache: str, block: int, out: Path) -> Path:
    text = (source / "tests" / "test_server.py").read_text()
    text = text.replace(f'"{HUB_MODEL}"', repr(str(model)))
    if cache == "store":
        text = re.sub(r"\bLRUPromptCache\(", "_store_cache(", text)
        head, sep, rest = text.partition("\nclass ")
        text = head + PRELUDE.format(block=block) + sep + rest
    path = out / f"test_server_{cache}.py"
    path.write_text(text)
    return path


def run(path: Path, select: str | None) -> dict[str, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(path)]
    if select:
        cmd += ["-k", select]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=path.parent, timeout=1800)
    got = {}
    for line in p.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED) \S*?::(\S+)", line)
        if m:
            got[m.group(2)] = m.group(1)
    if not got:
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="mlx-lm's unpacked source folder (holding tests/test_server.py)")
    ap.add_argument("--runs", type=int, default=1, help="runs of each file (failures counted per test)")
    ap.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    ap.add_argument("--block-size", type=int, default=16, help="the store's block size (mlx-lm's prompts are short)")
    args = ap.parse_args(argv)
    from kvstore.adapters.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="mlx-lm-server-tests-") as tmp:
        out = Path(tmp)
        model = make_tiny_model("llama", out / "model")
        failed: dict[str, Counter] = {"lru": Counter(), "store": Counter()}
        names: set[str] = set()
        for cache in ("lru", "store"):
            path = prepare(args.source, model, cache, args.block_size, out)
            for _ in range(args.runs):
                got = run(path, args.select)
                names |= set(got)
                failed[cache].update(n for n, r in got.items() if r in ("FAILED", "ERROR"))
    print(f"{'test':64} {'LRUPromptCache':>16} {'StorePromptCache':>16}  (failed runs of {args.runs})")
    for n in sorted(names):
        print(f"{n:64} {failed['lru'][n]:>16} {failed['store'][n]:>16}")
    only_store = sorted(n for n in names if failed["store"][n] and not failed["lru"][n])
    print("failed with the store only:", ", ".join(only_store) or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
