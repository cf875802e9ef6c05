"""Every error of the `kvstore` command is one line on stderr and exit code 2, found before a model loads or a
command runs, and leaves nothing half-made (issue 51). Real subprocesses, real LMDB stores, a real full
filesystem (a small tmpfs, where this user may mount one) and a real unreadable folder (root without the
capabilities that bypass file permissions)."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvstore import KVLayer, PrefixStore

from ._helpers import small_tmpfs

MODEL = "errors-model"


def kvstore(*args, preexec_fn=None):
    return subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, preexec_fn=preexec_fn)


def one_line_error(res, *words) -> str:
    """The single line a refused command printed (exit 2, no traceback), holding ``words``."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (res.returncode, res.stderr)
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


def fill(path, n_prompts=1, tokens=64, heads=1, model_info=None):
    """A store of ``n_prompts`` prompts of ``tokens`` tokens (4 layers of ``heads`` x 64 fp16 rows)."""
    with PrefixStore(budget_gb=0.5, ssd_path=path, block_size=16) as store:
        store.register_model(MODEL, model_info or {"name": "tiny"})
        for i in range(n_prompts):
            mx.random.seed(i)
            kv = lambda: mx.random.normal((1, heads, tokens, 64)).astype(mx.float16)  # noqa: E731
            store.put(MODEL, [1000 * i + t for t in range(tokens)], [KVLayer(kv(), kv()) for _ in range(4)])
        store.flush()
    return path


# ------------------------------------------------------------------ kvstore run


def test_run_on_a_path_that_is_no_store_is_refused_before_the_command_runs(tmp_path):
    marker = tmp_path / "ran"
    res = kvstore("run", "--ssd-path", "/etc", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    one_line_error(res, "/etc", "not a kvstore store")
    assert not marker.exists()  # the engine never started (it would have loaded its model first)


def test_run_of_a_command_that_is_not_there_names_it_and_makes_no_store(tmp_path):
    store = tmp_path / "store"
    one_line_error(kvstore("run", "--ssd-path", store, "--", "/no/such/command"), "/no/such/command", "no such command")
    one_line_error(kvstore("run", "--ssd-path", store, "--", "no-such-command-i51"), "no-such-command-i51", "$PATH")
    assert not store.exists()
    script = tmp_path / "bad-interpreter"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    one_line_error(kvstore("run", "--ssd-path", store, "--", script), str(script), "cannot run it")


# ---------------------------------------------------------- export and import


def test_export_to_an_existing_directory_is_one_line_and_writes_nothing(tmp_path):
    store, folder = fill(tmp_path / "store"), tmp_path / "out"
    folder.mkdir()
    one_line_error(kvstore("export", store, folder), str(folder), "is a directory")
    assert list(folder.iterdir()) == [] and not Path(f"{folder}.partial").exists()


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs: a device that fills up for real."""
    with small_tmpfs(tmp_path / "mnt", "3m") as mnt:
        yield mnt


def test_an_import_onto_a_full_device_leaves_no_new_store_and_an_old_one_whole(tmp_path, small_fs):
    src = fill(tmp_path / "src", n_prompts=4, tokens=256, heads=4)  # 8 MiB of fp16 KV: more than the device holds
    file = tmp_path / "cache.kvx"
    assert kvstore("export", src, file).returncode == 0
    new = small_fs / "a" / "store"
    one_line_error(kvstore("import", new, file), str(new), "no space left", "nothing is left")
    assert list(small_fs.iterdir()) == []  # the folders and the store it made are gone

    have = fill(small_fs / "have", tokens=32)  # a store already there: what it held stays, whole
    one_line_error(kvstore("import", have, file), str(have), "no space left", "verify")
    assert kvstore("verify", have).returncode == 0
    with PrefixStore(budget_gb=0.1, ssd_path=have, readonly=True) as store:
        assert store.fetch(MODEL, list(range(32))).length == 32


# --------------------------------------------------------------------- inspect


def _no_file_permission_override():
    """In the child: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so root meets file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _shows_ids_with_one_warning(res, model_dir):
    assert res.returncode == 0, res.stderr
    warnings = res.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and str(model_dir) in warnings[0], res.stderr
    assert "Traceback" not in res.stderr and "0 1 2 3 4 5 6 7 …" in res.stdout


def test_inspect_of_a_model_whose_tokenizer_cannot_be_read_shows_token_ids_with_a_warning(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{ not json")  # a damaged tokenizer
    store = fill(tmp_path / "store", model_info={"name": "tiny", "path": str(model)})
    _shows_ids_with_one_warning(kvstore("inspect", store), model)
    rows = [json.loads(line) for line in kvstore("inspect", store, "--json").stdout.splitlines()]
    assert [r["tokens"] for r in rows] == [64]


def test_inspect_of_a_model_folder_this_user_cannot_enter_shows_token_ids_with_a_warning(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    store = fill(tmp_path / "store", model_info={"name": "tiny", "path": str(model)})
    model.chmod(0)  # another user's folder: stat of its tokenizer.json raises PermissionError
    try:
        if os.access(model / "tokenizer.json", os.F_OK) and os.geteuid() != 0:
            pytest.skip("this user can still read a folder of mode 000")
        try:
            res = kvstore("inspect", store, preexec_fn=_no_file_permission_override if os.geteuid() == 0 else None)
        except subprocess.SubprocessError as e:
            pytest.skip(f"cannot drop root's file-permission override here: {e}")
        _shows_ids_with_one_warning(res, model)
        assert "Permission" in res.stderr
    finally:
        model.chmod(0o755)


@pytest.mark.parametrize("option", ["--limit", "--min-tokens"])
def test_inspect_refuses_a_negative_count(tmp_path, option):
    store = fill(tmp_path / "store")
    one_line_error(kvstore("inspect", store, option, "-3"), option)


# ------------------------------------------------------------ the small items


def test_flags_take_no_value_and_help_shows_none(tmp_path):
    store = fill(tmp_path / "store")
    for cmd in ("inspect", "stats", "verify"):
        help_text = kvstore(cmd, "--help").stdout
        line = next(l for l in help_text.splitlines() if "--json" in l)
        assert "<bool>" not in line, line
        one_line_error(kvstore(cmd, store, "--json", "true"), "true")


def test_verify_json(tmp_path):
    store = fill(tmp_path / "store")
    res = kvstore("verify", store, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"path": str(store), "checked": 4, "bad": 0, "orphans": 0, "removed": 0,
                                      "blocks": []}


def test_stats_labels_its_counts_and_says_nothing_of_reuse_where_unused(tmp_path):
    store = fill(tmp_path / "store")
    with PrefixStore(budget_gb=0.1, ssd_path=store) as s:
        assert s.fetch(MODEL, list(range(64))).length == 64
    text = kvstore("stats", store).stdout
    assert "ssd_admit=reuse" not in text
    assert "(1 read timed)" in text and "x)" not in text, text


def test_an_engine_not_installed_is_named_with_how_to_install_it():
    from importlib.util import find_spec

    if find_spec("vllm_mlx") is not None:
        pytest.skip("vllm-mlx is installed")
    line = one_line_error(kvstore("vllm-mlx", "serve", "m"), "vllm-mlx is not installed", "pip install 'vllm-mlx==")
    assert "unknown" not in line
