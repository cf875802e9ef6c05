"""Corruption: flipped, torn or foreign bytes in stored blocks and index
records, and a truncated or garbage ``data.mdb``.

A bad block must become a miss or a shorter hit (never an exception, never
wrong KV), be logged once, be reported by ``kvstore verify`` (exit 1) and be
removed by ``--repair``. A data file LMDB cannot use must give a clear
``StoreOpenError`` naming the path, from a process that exits normally
(truncated maps can SIGBUS, so those opens run in a child process).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import msgpack
import pytest

from kvstore import PrefixStore
from kvstore.blocks.header import read_header

from . import kvdata as D

MODEL = "corrupt-model"
N_PROMPTS = 4


def _prompts() -> list:
    return [D.tokens(900 + i, 70 + 9 * i) for i in range(N_PROMPTS)]


def _build(path: Path) -> list:
    prompts = _prompts()
    with PrefixStore(budget_gb=0.01, ssd_path=path, block_size=D.BLOCK) as store:
        for toks in prompts:
            store.put(MODEL, toks, D.layers_for(toks))
    return prompts


def _open(path: Path) -> PrefixStore:
    # budget 0: nothing stays in RAM, every fetch reads LMDB
    return PrefixStore(budget_gb=0, ssd_path=path, block_size=D.BLOCK)


def _bad_logs(caplog) -> list:
    return [r for r in caplog.records if r.name == "kvstore" and r.levelno >= logging.WARNING and " is bad" in r.getMessage()]


def _flip(offset_of):
    def fn(v: bytes) -> bytes:
        b = bytearray(v)
        b[offset_of(v)] ^= 0x10
        return bytes(b)
    return fn


def _header_end(v: bytes) -> int:
    return 20 + int.from_bytes(v[8:12], "little")


MUTATIONS = {
    "magic": _flip(lambda v: 1),
    "version": _flip(lambda v: 4),
    "header_length": _flip(lambda v: 8),
    "header_checksum": _flip(lambda v: 15),
    "header": _flip(lambda v: 30),
    "padding": _flip(lambda v: _header_end(v) + 1),
    "tokens": _flip(lambda v: read_header(v).payload_start + 5),
    "kv_payload": _flip(lambda v: len(v) // 2 + 3),
    "last_byte": _flip(lambda v: len(v) - 1),
    "truncated": lambda v: v[: len(v) - 100],
    "truncated_to_header": lambda v: v[:40],
    "extended": lambda v: v + b"\0" * 64,
    "empty": lambda v: b"",
    "random_same_size": lambda v: random.Random(len(v)).randbytes(len(v)),
    "zeroed": lambda v: bytes(len(v)),
}


@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_bad_block_is_a_shorter_hit_logged_once(tmp_path, caplog, kind):
    path = tmp_path / "store"
    prompts = _build(path)
    victim, bad_start = prompts[1], 32
    D.rewrite(path, D.block_key(MODEL, victim, bad_start), MUTATIONS[kind])
    caplog.set_level(logging.INFO, logger="kvstore")
    store = _open(path)
    try:
        for attempt in range(3):
            hit = store.fetch(MODEL, victim)
            assert D.hit_problem(hit, victim) is None
            assert hit.length == bad_start, f"attempt {attempt}: hit {hit.length}, bad block starts at {bad_start}"
        assert len(_bad_logs(caplog)) == 1, [r.getMessage() for r in _bad_logs(caplog)]
        assert store.stats()["corrupt_blocks"] == 1
        for toks in prompts[:1] + prompts[2:]:  # the other prompts are untouched
            hit = store.fetch(MODEL, toks)
            assert hit.length == len(toks) and D.hit_problem(hit, toks) is None
        # the prompt can be stored again and is then served whole
        store.put(MODEL, victim, D.layers_for(victim))
        store.flush()
        hit = store.fetch(MODEL, victim)
        assert hit.length == len(victim) and D.hit_problem(hit, victim) is None
    finally:
        store.close()
    rc, out = D.run_verify(path)
    assert rc == 0, out


@pytest.mark.parametrize("kind", ["kv_payload", "truncated", "header"])
def test_verify_reports_and_repair_removes_a_bad_block(tmp_path, caplog, kind):
    path = tmp_path / "store"
    prompts = _build(path)
    victim, bad_start = prompts[2], 48
    key = D.block_key(MODEL, victim, bad_start)
    D.rewrite(path, key, MUTATIONS[kind])
    rc, out = D.run_verify(path)
    assert rc == 1, out
    assert f"bad {key.hex()[:16]} tokens {bad_start}-{bad_start + D.BLOCK}" in out, out
    assert "1 bad" in out
    rc, out = D.run_verify(path, repair=True)
    assert rc == 1 and "removed" in out, out  # this run found it bad, and removed it and the blocks under it
    rc, out = D.run_verify(path)
    assert rc == 0 and ", 0 bad" in out, out
    caplog.set_level(logging.INFO, logger="kvstore")
    with _open(path) as store:
        hit = store.fetch(MODEL, victim)
        assert hit.length == bad_start and D.hit_problem(hit, victim) is None
        for toks in prompts[:2] + prompts[3:]:
            hit = store.fetch(MODEL, toks)
            assert hit.length == len(toks) and D.hit_problem(hit, toks) is None
    assert not _bad_logs(caplog)


def _replace_once(v: bytes, old: bytes, new: bytes) -> bytes:
    assert v.count(old) == 1, "the mutation must change the record"
    return v.replace(old, new)


META_MUTATIONS = {
    "truncated": lambda v: v[: len(v) // 2],
    "garbage": lambda v: random.Random(7).randbytes(len(v)),
    "not_a_map": lambda v: b"\x93\x01\x02\x03",
    "renamed_field": lambda v: _replace_once(v, b"\xa5start", b"\xa5START"),  # a required field's name damaged
    "flipped_type": lambda v: msgpack.packb({**msgpack.unpackb(v), "start": "16"}),  # a field of the wrong type
    "empty": lambda v: b"",
}


@pytest.mark.parametrize("kind", list(META_MUTATIONS))
def test_bad_index_record_is_skipped_reported_and_repaired(tmp_path, caplog, kind):
    """A torn index record (the ``nodes`` meta of a block) hides that block and
    the ones under it; the store still opens, and verify finds it."""
    path = tmp_path / "store"
    prompts = _build(path)
    victim, bad_start = prompts[3], 16
    key = D.block_key(MODEL, victim, bad_start)
    D.rewrite(path, key, META_MUTATIONS[kind], db=b"nodes")
    caplog.set_level(logging.INFO, logger="kvstore")
    with _open(path) as store:
        hit = store.fetch(MODEL, victim)
        assert hit.length == bad_start and D.hit_problem(hit, victim) is None
        for toks in prompts[:3]:
            hit = store.fetch(MODEL, toks)
            assert hit.length == len(toks) and D.hit_problem(hit, toks) is None
    assert any("unreadable index record" in r.getMessage() for r in caplog.records)
    rc, out = D.run_verify(path)
    assert rc == 1 and f"bad {key.hex()[:16]}" in out and "index record unreadable" in out, out
    assert "Traceback" not in out
    rc, out = D.run_verify(path, repair=True)
    assert rc == 1 and "removed" in out, out
    rc, out = D.run_verify(path)
    assert rc == 0, out
    with _open(path) as store:  # the prompt is stored again, whole
        store.put(MODEL, victim, D.layers_for(victim))
        store.flush()
    with _open(path) as store:
        hit = store.fetch(MODEL, victim)
        assert hit.length == len(victim) and D.hit_problem(hit, victim) is None


def random_injections(tmp_path: Path, n: int, seed: int) -> tuple[int, int]:
    """``n`` times: one random mutation of one random block; returns
    (injected, detected). Detected means the fetch stopped exactly at that
    block, logged it once, and returned exact KV for the rest."""
    rng = random.Random(seed)
    path = tmp_path / "store"
    prompts = _build(path)
    kinds = ["flip", "flip", "flip", "truncate", "extend", "overwrite", "splice"]
    detected = 0
    log = logging.getLogger("kvstore")
    for i in range(n):
        toks = rng.choice(prompts)
        start = rng.randrange(0, len(toks) // D.BLOCK) * D.BLOCK
        kind = rng.choice(kinds)

        def mutate(v: bytes) -> bytes:
            b = bytearray(v)
            if kind == "flip":
                pos = rng.randrange(len(b))
                b[pos] ^= 1 << rng.randrange(8)
            elif kind == "truncate":
                del b[rng.randrange(len(b)):]
            elif kind == "extend":
                b += rng.randbytes(rng.randrange(1, 200))
            elif kind == "overwrite":
                pos = rng.randrange(len(b))
                b[pos:pos + 8] = rng.randbytes(8)
                b = b[:len(v)]
            else:  # a run of bytes from elsewhere in the block
                a, c = sorted(rng.sample(range(len(b)), 2))
                b[a:c] = b[:c - a]
            if bytes(b) == v:
                b[0] ^= 0xFF
            return bytes(b)

        D.rewrite(path, D.block_key(MODEL, toks, start), mutate)
        records: list = []
        handler = logging.Handler()
        handler.emit = records.append
        log.addHandler(handler)
        try:
            with _open(path) as store:
                hits = [store.fetch(MODEL, toks) for _ in range(2)]
                problems = [D.hit_problem(h, toks) for h in hits]
                assert problems == [None, None], (i, kind, problems)  # never wrong KV, whatever happened
                bad = [r for r in records if " is bad" in r.getMessage()]
                if all(h.length == start for h in hits) and len(bad) == 1:
                    detected += 1
                # store it again for the next round
                store.put(MODEL, toks, D.layers_for(toks))
        finally:
            log.removeHandler(handler)
    rc, out = D.run_verify(path)
    assert rc == 0, out
    return n, detected


def test_random_corruptions_are_all_detected(tmp_path, figures):
    injected, detected = random_injections(tmp_path, 40, seed=3)
    figures(f"{detected} of {injected} random block corruptions detected, 0 wrong hits")
    assert detected == injected


@pytest.mark.soak
def test_random_corruptions_soak(tmp_path, figures):
    injected, detected = random_injections(tmp_path, 1000, seed=4)
    figures(f"{detected} of {injected} random block corruptions detected, 0 wrong hits")
    assert detected == injected


# ----------------------------------------------------------- the data file

def _open_in_child(path: Path) -> str:
    return D.open_in_child(path, MODEL, 900, 70, budget_gb=0)


def _committed_bytes(f: Path) -> int:
    """Where the store's committed pages end: a store on a writable map has
    its file allocated past them (free space to grow into), so truncating
    that tail removes nothing."""
    env = D.open_env(f.parent, readonly=True)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def _truncate(n_of_size):
    return lambda f: os.truncate(f, n_of_size(_committed_bytes(f)))


def _garbage(keep: int, fill=None):
    def fn(f):
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            fh.seek(keep)
            fh.write(fill(size - keep) if fill else random.Random(size).randbytes(size - keep))
    return fn


DATA_MUTATIONS = {
    "truncated_half": _truncate(lambda n: n // 2),
    "truncated_one_page": _truncate(lambda n: n - 4096),
    "truncated_to_meta_pages": _truncate(lambda n: 8192),
    "truncated_inside_meta": _truncate(lambda n: 100),
    "garbage": _garbage(0),
    "zeros": _garbage(0, bytes),
    "garbage_after_meta_pages": _garbage(8192),
}


@pytest.mark.parametrize("kind", list(DATA_MUTATIONS))
def test_unusable_data_file_gives_a_clear_open_error(tmp_path, kind):
    path = tmp_path / "store"
    _build(path)
    DATA_MUTATIONS[kind](path / "data.mdb")
    before = (path / "data.mdb").read_bytes()
    out = _open_in_child(path)
    assert out.startswith("StoreOpenError:") and str(path) in out, out
    assert "delete" in out.lower()  # says what to do
    rc, text = D.run_verify(path)
    assert rc == 2 and str(path) in text and "Traceback" not in text, text
    assert (path / "data.mdb").read_bytes() == before  # nothing written into the broken file


def test_empty_data_file_opens_as_an_empty_store(tmp_path):
    """A zero-byte data.mdb (a store created and killed before its first
    commit) holds nothing to lose: it opens as a new store."""
    path = tmp_path / "store"
    _build(path)
    os.truncate(path / "data.mdb", 0)
    out = _open_in_child(path)
    assert out.startswith("opened; hit 0 None"), out
    rc, text = D.run_verify(path)
    assert rc == 0, text


def test_intact_block_under_another_key_is_not_served(tmp_path):
    """Two prompts that differ in their first block and share their second
    block's tokens: block 2 of one copied over block 2 of the other (a
    misdirected write, or LMDB pages swapped) must not be served as the
    other's KV, since its rows depend on another context."""
    path = tmp_path / "store"
    shared = D.tokens(950, 48)[D.BLOCK:]
    a = np.concatenate([D.tokens(951, D.BLOCK), shared])
    b = np.concatenate([D.tokens(952, D.BLOCK), shared])
    with PrefixStore(budget_gb=0.01, ssd_path=path, block_size=D.BLOCK) as store:
        for toks in (a, b):
            store.put(MODEL, toks, D.layers_for(toks))
    key_a, key_b = D.block_key(MODEL, a, D.BLOCK), D.block_key(MODEL, b, D.BLOCK)
    env = D.open_env(path, readonly=True)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        other = bytes(txn.get(key_b))
    env.close()
    D.rewrite(path, key_a, lambda _: other)
    rc, text = D.run_verify(path)
    assert rc != 0 and "moved or overwritten" in text, text
    with _open(path) as store:
        hit = store.fetch(MODEL, a)
        assert D.hit_problem(hit, a) is None, D.hit_problem(hit, a)
        assert hit.length == D.BLOCK  # the first block is intact and still served
