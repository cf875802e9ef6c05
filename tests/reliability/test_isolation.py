"""Isolation: model keys and namespaces never share or reveal blocks, even
for identical prompts, in RAM and on disk after reopening; the store's
directory and files are private to their owner."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstore import PrefixStore

from . import kvdata as D

PROMPT = D.tokens(80_000, 100)
ONLY_FIRST = D.tokens(80_001, 70)


def _tenant_puts(store: PrefixStore, model, salt: int, first: bool) -> None:
    store.put(model, PROMPT, D.layers_for(PROMPT, salt))
    if first:
        store.put(model, ONLY_FIRST, D.layers_for(ONLY_FIRST, salt))


def _tenant_checks(store: PrefixStore, model, salt: int, first: bool) -> None:
    hit = store.fetch(model, PROMPT)
    assert hit.length == len(PROMPT), (model, hit.length)
    assert D.hit_problem(hit, PROMPT, salt) is None, (model, D.hit_problem(hit, PROMPT, salt))
    hit = store.fetch(model, ONLY_FIRST)
    if first:
        assert hit.length == len(ONLY_FIRST) and D.hit_problem(hit, ONLY_FIRST, salt) is None
    else:
        assert hit.length == 0 and store.contains(model, ONLY_FIRST) == 0, (model, hit.length)
    # a longer prompt extending the shared one is served only this tenant's rows
    longer = D.tokens(80_002, 130, PROMPT)
    hit = store.fetch(model, longer)
    assert hit.length == len(PROMPT) and D.hit_problem(hit, longer, salt) is None


MODELS = ["llama-3-8b", "llama-3-8b-instruct", "a", "a\x01b", "ab", b"llama-3-8b\x00", b"\x00" * 16, "ü-model"]
# (a str key and its UTF-8 bytes name the same model on purpose)


def test_model_keys_never_share_blocks(tmp_path):
    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=D.BLOCK) as store:
        for i, m in enumerate(MODELS):
            _tenant_puts(store, m, salt=i + 1, first=i == 0)
        store.flush()
        for i, m in enumerate(MODELS):
            _tenant_checks(store, m, salt=i + 1, first=i == 0)
        assert store.fetch("never-stored", PROMPT).length == 0
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK) as store:  # from disk
        for i, m in enumerate(MODELS):
            _tenant_checks(store, m, salt=i + 1, first=i == 0)
        assert store.fetch("never-stored", PROMPT).length == 0


NAMESPACES = [None, "", "alice", "bob", "alice/x", "a\x01b"]


def test_namespaces_never_share_blocks(tmp_path):
    path = tmp_path / "store"
    for i, ns in enumerate(NAMESPACES):  # one tenant after the other on one directory
        with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=D.BLOCK, namespace=ns) as store:
            assert store.fetch("model", PROMPT).length == 0, f"namespace {ns!r} sees another tenant's blocks"
            assert store.fetch("model", ONLY_FIRST).length == 0
            _tenant_puts(store, "model", salt=i + 1, first=i == 0)
            store.flush()
            _tenant_checks(store, "model", salt=i + 1, first=i == 0)
    for budget in (0.1, 0):
        for i, ns in enumerate(NAMESPACES):
            with PrefixStore(budget_gb=budget, ssd_path=path, block_size=D.BLOCK, namespace=ns) as store:
                _tenant_checks(store, "model", salt=i + 1, first=i == 0)
    # a namespace and a model key do not stand in for each other
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK, namespace="model") as store:
        assert store.fetch("alice", PROMPT).length == 0
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK) as store:
        assert store.fetch("a", PROMPT).length == 0  # namespace "a\x01b" ... is not model "a"
    rc, out = D.run_verify(path)
    assert rc == 0, out


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_store_directory_and_files_are_private(tmp_path):
    old = os.umask(0)  # even a permissive umask gives private files
    try:
        path = tmp_path / "deep" / "er" / "store"
        with PrefixStore(ssd_path=path, block_size=D.BLOCK) as store:
            store.put("m", PROMPT, D.layers_for(PROMPT))
        assert _mode(path) == 0o700, oct(_mode(path))
        files = sorted(p.name for p in path.iterdir())
        assert files == ["data.mdb", "lock.mdb"], files
        for f in files:
            assert _mode(path / f) == 0o600, (f, oct(_mode(path / f)))
    finally:
        os.umask(old)
