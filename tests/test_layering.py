"""The package's layering: the store knows no engine, and the install adds no
generic top-level names."""

import ast
import pathlib
import subprocess
import sys

import pytest

import kvstore

CORE = pathlib.Path(kvstore.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_core_imports_no_adapter_tool_or_mlx_lm_module():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 5
    for f in files:
        bad = {m for m in _imports(f) if m.split(".")[0] in ("adapters", "tools", "mlx_lm")
               or m.startswith(("kvstore.adapters", "kvstore.tools"))}
        assert not bad, f"{f.relative_to(CORE.parent)} imports {bad}"


def _run(code: str, cwd) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          timeout=120, check=True).stdout.strip()


def test_import_kvstore_loads_no_engine(tmp_path):
    assert _run("import sys, kvstore; print(sorted(m for m in sys.modules if m.startswith('mlx_lm')))",
                tmp_path) == "[]"


def test_install_has_no_top_level_adapters_or_tools(tmp_path):
    # run outside the repository, so only what the install put on sys.path is found
    out = _run("import importlib.util as u; print(u.find_spec('adapters'), u.find_spec('tools'), "
               "u.find_spec('kvstore.adapters.mlx_lm') is not None, u.find_spec('kvstore.tools') is not None)",
               tmp_path)
    assert out == "None None True True"


def test_no_dead_code_outside_the_whitelist():
    """Every name in kvstore/, adapters/ and tools/ is used, or named in
    tools/vulture_whitelist.py with who uses it (public API, a framework's
    hook)."""
    pytest.importorskip("vulture")
    root = pathlib.Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, "-m", "vulture", "kvstore", "adapters", "tools", "--min-confidence", "60"],
                         cwd=root, capture_output=True, text=True)
    assert got.returncode == 0 and not got.stdout.strip(), got.stdout + got.stderr


def test_every_benchmark_file_and_anchor_the_docs_name_exists():
    root = pathlib.Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, str(root / "tools" / "check_doc_links.py")], cwd=root,
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr
