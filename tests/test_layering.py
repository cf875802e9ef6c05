"""The package's layering: the store knows no engine, the install adds no
generic top-level names, and the core's sub-packages depend one way (the data
flow: format below tiers below state below the paths that move blocks below
the facade), with no import cycle and no module too long to read."""

import ast
import pathlib
import subprocess
import sys

import pytest

import kvstore

CORE = pathlib.Path(kvstore.__file__).parent
ADAPTERS = pathlib.Path(__file__).resolve().parents[1] / "adapters"  # the repository's: the tests run from it


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


# The core's layers, lowest first: a module imports only from its own layer or lower ones (the
# package root ``kvstore`` excepted, for ``__version__``). Sub-packages are named by their job:
LAYERS = [
    {"errors", "background"},  # the exceptions; starting background threads (fork-safe)
    {"gpu"},  # the CUDA runtime and host buffers (the only place that knows CUDA)
    {"blocks"},  # what a block is: keys, layers, codec, header, bytes, records
    {"config", "counters", "hit"},  # the settings; what a store counts; what a fetch hands the engine
    {"convert"},  # engine arrays <-> blocks (encode, gather, assemble)
    {"tiers"},  # where blocks live: device, RAM, disk (LMDB), remote; one ``Tier`` protocol
    {"state"},  # which blocks the store knows and where: the index and the one table over it
    {"cost"},  # whether loading beats recomputing (the planner weighs a pinned path; it reads no tier)
    {"flow"},  # the put and fetch paths that carry out the table's plans: writer, reader, discovery, fetch
    {"admin"},  # the offline commands: inspect, verify, clear, export/import
    {"store", "inspection", "warmup", "__init__", "__main__"},  # the facade
]
MAX_LINES = 450


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _core_modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in CORE.rglob("*.py")}


def _runtime_imports(path: pathlib.Path, modules) -> set[str]:
    """The kvstore modules ``path`` imports, at module level or in a function
    (imports under ``if TYPE_CHECKING:`` are annotations, not imports)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "kvstore":
                for a in node.names:
                    out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "kvstore")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _core_modules()
    return {m: _runtime_imports(p, modules) for m, p in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of test_layering.LAYERS: add its package there")


def test_core_sub_packages_depend_one_way():
    bad = [f"{m} ({LAYERS[_layer(m)]}) imports {d} ({LAYERS[_layer(d)]})"
           for m, deps in _graph().items() for d in sorted(deps) if d != "kvstore" and _layer(d) > _layer(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_in_the_core():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_module_of_the_core_or_the_adapters_over_the_line_limit():
    files = list(_core_modules().values()) + sorted(ADAPTERS.rglob("*.py"))
    long = {str(p.relative_to(CORE.parent)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by job): {long}"


REPO = ADAPTERS.parent
DOC_LIMITS = {"README.md": 300, "docs/benchmarks.md": 450}  # lines: the quick start; the current tables


def test_the_docs_and_tools_stay_documentation_and_maintained_tools():
    """History lives in git: the README and the benchmarks page stay within their lines, docs/bench holds at
    most 20 result files, and tools/ at most 12 scripts beside the benchmarks of ``kvstore bench``."""
    long = {f: n for f, m in DOC_LIMITS.items() if (n := len((REPO / f).read_text().splitlines())) > m}
    assert not long, f"over their limits {DOC_LIMITS}: {long}"
    results = [p.name for p in (REPO / "docs" / "bench").iterdir() if p.is_file()]
    assert len(results) <= 20, f"docs/bench holds {len(results)} files: {sorted(results)}"
    scripts = [p.name for p in (REPO / "tools").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"]
    assert len(scripts) <= 12, f"{len(scripts)} tool scripts outside tools/bench: {sorted(scripts)}"


def _adapter_imports(path: pathlib.Path, names: set[str]) -> set[str]:
    """The adapters modules ``path`` imports (relatively or as ``kvstore.adapters.X``), anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1 or mod.startswith("kvstore.adapters"):
                mod = mod.removeprefix("kvstore.adapters").lstrip(".")
                out |= {a.name for a in node.names if not mod and a.name in names}
                out |= {mod.split(".")[0]} if mod else set()
    return (out & names) - {path.stem}


def test_no_import_cycle_in_the_adapters():
    files = {p.stem: p for p in ADAPTERS.glob("*.py")}
    graph = {m: _adapter_imports(p, set(files)) for m, p in files.items()}
    done: set[str] = set()

    def visit(m, stack):
        for d in sorted(graph[m]):
            assert d not in stack, "import cycle: " + " -> ".join(stack[stack.index(d):] + [d])
            if d not in done:
                visit(d, stack + [d])
        done.add(m)

    for m in sorted(graph):
        visit(m, [m])


def test_node_never_leaves_the_state_package():
    """Block state has one owner: ``Node`` is named only in kvstore/state/
    (the index and the table over it); everything else gets ``BlockRef``s,
    immutable, and hands them back to the table."""
    named = []
    for m, p in _core_modules().items():
        if m.startswith("kvstore.state."):
            continue
        tree = ast.parse(p.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value.isidentifier()}
        if "Node" in names:
            named.append(m)
    assert not named, f"Node named outside kvstore/state/: {named}"


def test_each_tier_is_held_by_its_facade_alone():
    """The store's LMDB tier is ``Disk``'s (flow/disk) and its remote tier
    ``Remote``'s (tiers/remote/sync), each as ``self._tier``: the rest of the
    core asks the facade for what it needs, never reaches through it."""
    reached = [f"{m}:{n.lineno}: {ast.unparse(n)}" for m, p in _core_modules().items()
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Attribute) and n.attr in ("tier", "_tier")
               and not (isinstance(n.value, ast.Name) and n.value.id == "self")]
    assert not reached, "a tier reached through its facade:\n" + "\n".join(reached)


def test_the_cuda_runtime_is_asked_only_in_the_gpu_package():
    """The device backend is chosen in one place (``kvstore.gpu.backend.choose``):
    outside kvstore/gpu/, the core and the adapters are handed a ``Backend``
    or ask ``choose()``, never ``cuda.runtime`` (called or passed around)."""
    files = [p for p in CORE.rglob("*.py") if p.parent.name != "gpu"] + sorted(ADAPTERS.rglob("*.py"))
    asked = []
    for p in files:
        for n in ast.walk(ast.parse(p.read_text())):
            cuda_attr = (isinstance(n, ast.Attribute) and n.attr == "runtime"
                         and ast.unparse(n.value).split(".")[-1] == "cuda")
            imported = (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[-1] == "cuda"
                        and any(a.name == "runtime" for a in n.names))
            if cuda_attr or imported:
                asked.append(f"{p.relative_to(CORE.parent)}:{n.lineno}: {ast.unparse(n)}")
    assert not asked, "cuda.runtime outside kvstore/gpu/ (take a Backend, or gpu.backend.choose()):\n" + "\n".join(asked)


MAX_COMPLEXITY = 20  # radon's cyclomatic complexity: a function over it is split into named steps


def test_no_function_of_the_core_over_the_complexity_limit():
    radon = pytest.importorskip("radon.complexity")
    over = {f"{m}:{f.fullname}": f.complexity for m, p in _core_modules().items()
            for f in radon.cc_visit(p.read_text())  # functions and methods (a class's figure is its methods')
            if f.letter != "C" and f.complexity > MAX_COMPLEXITY}
    assert not over, f"over cyclomatic complexity {MAX_COMPLEXITY} (split into named steps): {over}"
