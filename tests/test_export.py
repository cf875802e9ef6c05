"""`kvstore export` / `kvstore import` (kvstore.admin.transfer): a store's entries carried in one file,
checked whole before anything of it is written. Real LMDB stores, real mlx arrays, a real tiny
mlx-lm model, the CLI as a subprocess, and an engine process beside an import."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvstore import PrefixStore
from kvstore.errors import TransferError
from kvstore.admin.transfer import MAGIC, PREFIX, export_store, import_store

from ._helpers import assert_hit_is, kv_layers, same

MODEL = "import-model"  # as tests/_import_child.py
BS = 16
PROMPTS = [list(range(40)) + [100 + i] * (10 + 10 * i) for i in range(3)]  # a shared 40-token start
ROOT = Path(__file__).resolve().parent.parent


def kvstore(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


def fill(path, prompts=PROMPTS, model=MODEL, block_size=BS, **kw):
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=block_size, **kw) as store:
        store.register_model(model, {"name": "tiny"})
        for p in prompts:
            store.put(model, p, kv_layers(p))
        store.flush()


def served(path, prompts=PROMPTS, model=MODEL, **kw) -> list[int]:
    """Tokens each prompt gets from a fresh engine on ``path``, each hit checked bit-exact."""
    with PrefixStore(budget_gb=0.1, ssd_path=path, **kw) as store:
        out = []
        for p in prompts:
            hit = store.fetch(model, p)
            if hit.length:
                assert_hit_is(hit, p, hit.length)
            out.append(hit.length)
    return out


def blocks_in(path) -> int:
    if not (Path(path) / "data.mdb").exists():
        return 0
    return json.loads(kvstore("stats", path, "--json").stdout)["blocks"]


@pytest.fixture
def exported(tmp_path):
    src = tmp_path / "src"
    fill(src)
    file = tmp_path / "cache.kvx"
    res = kvstore("export", src, file)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # no progress bar where stderr is no terminal
    assert "exported 9 blocks" in res.stdout, res.stdout
    return src, file


def test_export_then_import_into_a_new_store_serves_every_prompt_bit_exact(exported, tmp_path):
    src, file = exported
    res = kvstore("import", tmp_path / "dst", file)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "imported 9 blocks" in res.stdout and "0 already there" in res.stdout
    assert served(tmp_path / "dst") == [50, 60, 70]
    assert kvstore("verify", tmp_path / "dst").returncode == 0
    again = kvstore("import", tmp_path / "dst", file)  # blocks already there are skipped, counted
    assert again.returncode == 0 and "imported 0 blocks" in again.stdout and "9 already there" in again.stdout
    assert blocks_in(tmp_path / "dst") == 9


def test_the_kv_of_a_real_model_comes_back_bit_exact(tmp_path):
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.adapters.generate import model_key, store_cache
    from kvstore.adapters.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "model")
    model, _ = load(str(path))
    key = model_key(model, path)
    tokens = np.random.default_rng(0).integers(10, 400, size=75).tolist()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    with PrefixStore(budget_gb=0.1, ssd_path=tmp_path / "src", block_size=BS) as store:
        store_cache(store, key, tokens, cache)
        store.flush()
    report = export_store(tmp_path / "src", tmp_path / "f.kvx", model_key=key)
    assert report.blocks == 5 and report.skipped == 0
    assert import_store(tmp_path / "dst", tmp_path / "f.kvx").blocks == 5
    with PrefixStore(budget_gb=0.1, ssd_path=tmp_path / "dst") as store:
        hit = store.fetch(key, tokens)
    assert hit.length == 75 and hit.ssd_tokens == 75
    for layer, c in zip(hit.layers, cache, strict=True):
        assert same(layer.keys, c.keys[..., :75, :]) and same(layer.values, c.values[..., :75, :])


def _flipped(file: Path, at: int, out: Path) -> Path:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x10
    out.write_bytes(bytes(data))
    return out


def _payload_at(src: Path, file: Path) -> int:
    """Where the KV bytes of one stored block lie in the export file."""
    import lmdb
    env = lmdb.open(str(src), max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        _, value = next(iter(txn.cursor(db=env.open_db(b"blocks", txn=txn, create=False))))
        value = bytes(value)
    env.close()
    at = file.read_bytes().find(value)
    assert at > 0
    return at + len(value) - 7  # in the last array: KV, not the block's header


@pytest.mark.parametrize("where", ["payload", "header", "magic", "end"])
def test_a_file_with_one_byte_flipped_is_refused_and_nothing_is_written(exported, tmp_path, where):
    src, file = exported
    data = file.read_bytes()
    at = {"payload": _payload_at(src, file), "header": PREFIX.size + 30, "magic": 3, "end": len(data) - 5}[where]
    bad = _flipped(file, at, tmp_path / "bad.kvx")
    fill(tmp_path / "dst", [list(range(500, 540))])  # a store with an entry of its own
    res = kvstore("import", tmp_path / "dst", bad)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert ("not a kvstore export file" if where == "magic" else "damaged") in res.stderr, res.stderr
    assert blocks_in(tmp_path / "dst") == 3  # its own, nothing of the file
    assert served(tmp_path / "dst") == [0, 0, 0]


def test_any_flipped_byte_is_refused_or_imports_only_exact_kv(exported, tmp_path):
    """Sampled over the whole file: an import either raises (and writes nothing) or serves bit-exact."""
    _, file = exported
    size = file.stat().st_size
    for i, at in enumerate(range(0, size, max(1, size // 60))):
        dst = tmp_path / f"dst{i}"
        bad = _flipped(file, at, tmp_path / "bad.kvx")
        try:
            import_store(dst, bad)
        except TransferError:
            assert not dst.exists(), f"byte {at}: a refused file made a store"
            continue
        assert served(dst) == [50, 60, 70], f"byte {at}"


@pytest.mark.parametrize("cut", ["inside a block", "before the end frame", "inside the prefix"])
def test_a_truncated_file_is_refused(exported, tmp_path, cut):
    src, file = exported
    data = file.read_bytes()
    n = {"inside a block": _payload_at(src, file), "before the end frame": data.rindex(b"\x93\xa3end"),
         "inside the prefix": 5}[cut]
    (tmp_path / "cut.kvx").write_bytes(data[:n])
    res = kvstore("import", tmp_path / "dst", tmp_path / "cut.kvx")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert ("not a kvstore export file" if cut == "inside the prefix" else "truncated") in res.stderr, res.stderr
    assert not (tmp_path / "dst").exists()


def test_foreign_files_are_refused_with_a_clear_error(exported, tmp_path):
    src, _ = exported
    (tmp_path / "random").write_bytes(np.random.default_rng(1).bytes(5000))
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "v9").write_bytes(PREFIX.pack(MAGIC, 9) + b"\x90")
    cases = {"random": "not a kvstore export file", "empty": "not a kvstore export file",
             src / "data.mdb": "not a kvstore export file", "v9": "format 9", tmp_path / "missing": "cannot read"}
    for name, why in cases.items():
        res = kvstore("import", tmp_path / "dst", tmp_path / name)
        assert res.returncode == 2 and why in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "dst").exists()
    # a file of the right magic whose frames are garbage
    (tmp_path / "junk").write_bytes(PREFIX.pack(MAGIC, 1) + np.random.default_rng(2).bytes(3000))
    res = kvstore("import", tmp_path / "dst", tmp_path / "junk")
    assert res.returncode == 2 and ("damaged" in res.stderr or "truncated" in res.stderr), res.stderr


def test_a_store_of_another_block_size_refuses_the_file(exported, tmp_path):
    _, file = exported
    fill(tmp_path / "dst", [list(range(500, 540))], block_size=8)
    res = kvstore("import", tmp_path / "dst", file)
    assert res.returncode == 2 and "16 tokens" in res.stderr and "of 8" in res.stderr, res.stderr
    assert blocks_in(tmp_path / "dst") == 5


def test_model_key_and_namespace_filters(tmp_path):
    src = tmp_path / "src"
    fill(src, PROMPTS[:1], model="a")
    fill(src, PROMPTS[1:2], model="b")
    fill(src, PROMPTS[2:], model="a", namespace="team")
    a, b, team, none = [50, 40, 40], [40, 60, 40], [40, 40, 70], [0, 0, 0]  # (the prompts share 40 tokens)
    for args, want in [(["--model-key", "a"], {"a": a, "b": none, "team": team}),  # every namespace
                       (["--model-key", "a", "--namespace", "team"], {"a": none, "b": none, "team": team}),
                       (["--namespace", "team"], {"a": none, "b": none, "team": team}),
                       (["--model-key", "b"], {"a": none, "b": b, "team": none})]:
        dst = tmp_path / ("dst" + "-".join(args))
        assert kvstore("export", src, tmp_path / "f.kvx", *args).returncode == 0
        assert kvstore("import", dst, tmp_path / "f.kvx").returncode == 0
        got = {"a": served(dst, model="a"), "b": served(dst, model="b"),
               "team": served(dst, model="a", namespace="team")}
        assert got == want, args
    nobody = kvstore("export", src, tmp_path / "n.kvx", "--model-key", "nobody")  # not "0 blocks exported"
    assert nobody.returncode == 2 and "no model 'nobody'" in nobody.stderr and not (tmp_path / "n.kvx").exists()


def test_export_leaves_out_a_damaged_block_and_the_blocks_below_it(tmp_path):
    import lmdb
    src = tmp_path / "src"
    fill(src, PROMPTS[:1])  # blocks at 0, 16, 32, 48
    env = lmdb.open(str(src), max_dbs=8)
    nodes, blocks = env.open_db(b"nodes", create=False), env.open_db(b"blocks", create=False)
    from kvstore.blocks.record import BlockRecord
    with env.begin(write=True) as txn:
        key = next(bytes(k) for k, v in txn.cursor(db=nodes) if BlockRecord.unpack(bytes(k), v).start == 32)
        bad = bytearray(txn.get(key, db=blocks))
        bad[-3] ^= 0xFF
        txn.put(key, bytes(bad), db=blocks)
    env.close()
    report = export_store(src, tmp_path / "f.kvx")
    assert (report.blocks, report.skipped) == (2, 2)
    import_store(tmp_path / "dst", tmp_path / "f.kvx")
    assert served(tmp_path / "dst", PROMPTS[:1]) == [32]


def test_import_beside_a_running_engine_which_then_serves_the_prompts(exported, tmp_path):
    _, file = exported
    dst = tmp_path / "dst"
    child = subprocess.Popen([sys.executable, "-m", "tests._import_child", str(dst)], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        child.stdin.write(json.dumps(PROMPTS) + "\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == [0, 0, 0]  # before the import: misses
        res = kvstore("import", dst, file)
        assert res.returncode == 0 and "imported 9 blocks" in res.stdout, res.stderr
        child.stdin.write(json.dumps(PROMPTS) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, child.stderr.read()
        assert json.loads(line) == [50, 60, 70]  # found on disk, checked bit-exact by the child
        child.stdin.close()
        assert child.wait(timeout=60) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
    assert kvstore("verify", dst).returncode == 0
    assert blocks_in(dst) == 9 + 3  # the file's and the engine's own


def test_a_progress_bar_on_a_terminal_and_none_with_quiet(exported, tmp_path):
    import pty

    src, file = exported

    def on_tty(*args) -> str:
        pid, fd = pty.fork()
        if pid == 0:
            os.execv(sys.executable, [sys.executable, "-m", "kvstore.adapters.cli", *map(str, args)])
        chunks = []
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        assert os.waitpid(pid, 0)[1] == 0
        return b"".join(chunks).decode(errors="replace")

    assert "exporting" in on_tty("export", src, tmp_path / "g.kvx")
    assert "exporting" not in on_tty("export", src, tmp_path / "g.kvx", "--quiet")
    assert "importing" in on_tty("import", tmp_path / "dst", file)


# ------------------------------------------------------------ signed files (format 2)

SECRET = "export-secret-for-tests"


def _frames(file: Path) -> tuple[bytes, list]:
    import msgpack

    data = file.read_bytes()
    return data[: PREFIX.size], list(msgpack.Unpacker(io.BytesIO(data[PREFIX.size:]), raw=False))


def _written(prefix: bytes, frames: list, out: Path) -> Path:
    import msgpack

    out.write_bytes(prefix + b"".join(msgpack.packb(f, use_bin_type=True) for f in frames))
    return out


def test_a_signed_export_imports_where_its_secret_verifies_it(tmp_path):
    fill(tmp_path / "src")
    file = tmp_path / "signed.kvx"
    res = kvstore("export", tmp_path / "src", file, "--sign", env=dict(os.environ, KVSTORE_EXPORT_SECRET=SECRET))
    assert res.returncode == 0 and "exported 9 blocks" in res.stdout and "signed" in res.stdout, res.stderr
    assert PREFIX.unpack(file.read_bytes()[: PREFIX.size])[1] == 2
    res = kvstore("import", tmp_path / "dst", file, "--verify", env=dict(os.environ, KVSTORE_EXPORT_SECRET=SECRET))
    assert res.returncode == 0 and "imported 9 blocks" in res.stdout and "signed, verified" in res.stdout
    assert served(tmp_path / "dst") == [50, 60, 70]
    plain = import_store(tmp_path / "dst2", file)  # no secret given: checked as any file, its tags not
    assert (plain.blocks, plain.signed, plain.verified) == (9, True, False)


def test_without_the_secret_no_file_passes_verification_and_nothing_is_written(exported, tmp_path):
    """Checksums catch damage, not forgery: a file written without the secret (unsigned, signed under
    another, or a signed file with one block's KV swapped and every checksum made to match) is refused
    whole by an import given the secret, while the swapped file passes an import without it."""
    src, unsigned = exported
    other = tmp_path / "other.kvx"
    export_store(src, other, secret="someone else's")
    signed = tmp_path / "signed.kvx"
    export_store(src, signed, secret=SECRET)
    # the forgery: block 4's KV from a store of the same tokens and other values, digests recomputed
    with PrefixStore(budget_gb=0.1, ssd_path=tmp_path / "evil", block_size=BS) as store:
        store.register_model(MODEL, {"name": "tiny"})
        for p in PROMPTS:
            store.put(MODEL, p, kv_layers(p, dim=32, dtype=mx.float32))
        store.flush()
    evil = tmp_path / "evil.kvx"
    export_store(tmp_path / "evil", evil)
    prefix, frames = _frames(signed)
    _, theirs = _frames(evil)
    from kvstore.admin.export_file import frame_digest
    import xxhash

    i = 4
    assert frames[i][1] == theirs[i][1] and frames[i][3] != theirs[i][3]  # the same block key, other KV
    frames[i] = theirs[i][:5] + [frames[i][5]]
    chain = xxhash.xxh3_128(frames[0][2])
    for f in frames[1:-1]:
        assert frame_digest(*f[1:4]) == f[4]
        chain.update(f[4])
    frames[-1][2] = chain.digest()
    forged = _written(prefix, frames, tmp_path / "forged.kvx")
    for bad in (unsigned, other, forged):
        with pytest.raises(TransferError, match="not signed"):
            import_store(tmp_path / "dst", bad, secret=SECRET)
        assert blocks_in(tmp_path / "dst") == 0
    assert import_store(tmp_path / "gullible", forged).blocks == 9  # what the signature guards against:
    with PrefixStore(budget_gb=0.1, ssd_path=tmp_path / "gullible") as store:  # KV that is not the prompt's
        hits = [(store.fetch(MODEL, p), kv_layers(p)) for p in PROMPTS]
    assert all(h.length == len(p) for (h, _), p in zip(hits, PROMPTS))
    assert not all(same(a.keys, b.keys) for h, ref in hits for a, b in zip(h.layers, ref))


def test_sign_and_verify_take_the_secret_from_the_environment_only(exported, tmp_path):
    src, file = exported
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_EXPORT_SECRET"}
    for args in (("export", src, tmp_path / "x.kvx", "--sign"), ("import", tmp_path / "dst", file, "--verify")):
        res = kvstore(*args, env=env)
        assert res.returncode == 2 and "KVSTORE_EXPORT_SECRET" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.kvx").exists() and blocks_in(tmp_path / "dst") == 0


def test_an_import_past_the_stores_disk_budget_evicts_least_recently_used_blocks_as_an_engine_would(exported,
                                                                                                     tmp_path):
    """Blocks keep their use times through an export; an import that takes a store past its disk budget
    deletes least recently used leaves until it is under again (an engine's rule after a write), and what
    stays serves bit-exact."""
    src, file = exported
    dst = tmp_path / "dst"
    budget = file.stat().st_size // 2  # about half of what the file holds
    with PrefixStore(budget_gb=0.1, ssd_path=dst, block_size=BS, disk_budget_gb=budget / (1 << 30)):
        pass  # (the budget an engine sets is the store's: an import keeps it)
    report = import_store(dst, file)
    assert report.blocks == 9 and report.evicted > 0
    with PrefixStore(budget_gb=0.1, ssd_path=dst, disk_budget_gb=budget / (1 << 30)) as store:
        st = store.stats()
        assert st["ssd_bytes"] <= st["ssd_budget"] == budget
        for p in PROMPTS:
            hit = store.fetch(MODEL, p)
            if hit.length:
                assert_hit_is(hit, p, hit.length)
    assert kvstore("verify", dst).returncode == 0
