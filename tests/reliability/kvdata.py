"""Deterministic prompts and KV for the reliability tests (also imported by
the child processes those tests start, so it depends on nothing but kvstore).

Row p of a prompt's KV is a function of (model salt, tokens[:p + 1], layer,
head, dim), integer-valued in [-1000, 1000] so float16 holds it exactly. Any
prefix a store returns can therefore be checked bit for bit, and KV served for
the wrong model, tenant, position, tokens or preceding context shows up as a
mismatch.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional, Sequence

import numpy as np

import mlx.core as mx

from kvstore import KVLayer

LAYERS = 2
HEADS = 2
DIM = 32
BLOCK = 16  # tokens per block in these tests: many blocks per prompt, small arrays
VOCAB = 30_000
KV_ROW_BYTES = LAYERS * 2 * HEADS * DIM * 2  # bytes of KV per token (float16)


def tokens(prompt_id: int, n: int, prefix: Optional[Sequence[int]] = None) -> np.ndarray:
    """``n`` tokens: ``prefix`` then tokens drawn from ``prompt_id``'s own stream."""
    head = np.asarray(prefix if prefix is not None else [], dtype=np.int32)[:n]
    rng = np.random.default_rng([7, prompt_id])
    tail = rng.integers(1, VOCAB, size=n - len(head), dtype=np.int32)
    return np.concatenate([head, tail]).astype(np.int32)


def shared_prefix(family: int, n: int) -> np.ndarray:
    """A prefix common to every prompt of ``family`` (a system prompt)."""
    rng = np.random.default_rng([11, family])
    return rng.integers(1, VOCAB, size=n, dtype=np.int32)


_P = (1 << 31) - 1


@functools.lru_cache(maxsize=4096)
def _prefix_codes(raw: bytes) -> np.ndarray:
    """Per position p, a hash of ``tokens[:p + 1]`` (KV depends on the whole prefix)."""
    toks = np.frombuffer(raw, dtype="<i4")
    out = np.empty(len(toks), dtype=np.int64)
    h = 12345
    for i, t in enumerate(toks.tolist()):
        h = (h * 1000003 + t + 1) % _P
        out[i] = h
    out.flags.writeable = False
    return out


def expected(toks: Sequence[int], layer: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values ``[1, HEADS, T, DIM]`` float16 of the prompt ``toks``.

    Row ``p`` depends on ``tokens[:p + 1]`` (as a model's KV does), the layer
    and the salt (the model), so the rows of any prefix are a slice of these.
    """
    code = _prefix_codes(np.asarray(toks, dtype="<i4").tobytes())[:, None]  # [T, 1]
    h = np.arange(HEADS, dtype=np.int64)[:, None, None]  # [H, 1, 1]
    d = np.arange(DIM, dtype=np.int64)[None, None, :]  # [1, 1, D]
    base = ((code % 1_000_003) * 131 + layer * 17 + salt * 7919)[None]  # [1, T, 1]
    k = (base + h * 5 + d) % 2001 - 1000
    v = (base * 3 + h * 11 + d * 7 + 500) % 2001 - 1000
    return k.astype(np.float16)[None], v.astype(np.float16)[None]


def layers_for(toks: Sequence[int], salt: int = 0) -> list[KVLayer]:
    out = []
    for li in range(LAYERS):
        k, v = expected(toks, li, salt)
        out.append(KVLayer(mx.array(k), mx.array(v)))
    return out


def hit_problem(hit, toks: Sequence[int], salt: int = 0) -> Optional[str]:
    """Why ``hit`` is not exactly the KV of a prefix of ``toks``, or ``None``."""
    n = hit.length
    if n == 0:
        return None if not hit.layers else "a miss that carries layers"
    if n < 0 or n > len(toks):
        return f"hit length {n} outside [1, {len(toks)}]"
    if hit.layers is None or len(hit.layers) != LAYERS:
        return f"hit of {n} tokens with {None if hit.layers is None else len(hit.layers)} layers"
    if hit.ram_tokens + hit.ssd_tokens != n:
        return f"ram {hit.ram_tokens} + ssd {hit.ssd_tokens} tokens != length {n}"
    for li, layer in enumerate(hit.layers):
        if not isinstance(layer, KVLayer) or layer.start != 0:
            return f"layer {li}: {type(layer).__name__} starting at {getattr(layer, 'start', '?')}"
        k, v = expected(toks[:n], li, salt)
        got_k, got_v = np.asarray(layer.keys), np.asarray(layer.values)
        if got_k.shape != k.shape or got_v.shape != v.shape:
            return f"layer {li}: shapes {got_k.shape}/{got_v.shape}, expected {k.shape}"
        if got_k.dtype != np.float16 or got_v.dtype != np.float16:
            return f"layer {li}: dtype {got_k.dtype}/{got_v.dtype}"
        if not (np.array_equal(got_k, k) and np.array_equal(got_v, v)):
            bad = int(np.flatnonzero((got_k != k).any(axis=(0, 1, 3)) | (got_v != v).any(axis=(0, 1, 3)))[0])
            return f"layer {li}: wrong KV from token {bad} of a {n}-token hit"
    return None


def kvstore_cli() -> list[str]:
    """How to run the ``kvstore`` command with this interpreter."""
    exe = os.path.join(os.path.dirname(sys.executable), "kvstore")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "kvstore.adapters.cli"]


def writer_prompt(seed: int, i: int) -> np.ndarray:
    """Prompt ``i`` of the crash writer with ``seed``: 20-119 tokens, often
    behind one of four shared prefixes, so prompts share blocks."""
    rng = np.random.default_rng([13, seed, i])
    n = int(rng.integers(20, 120))
    plen = int(rng.choice([0, 16, 24, 40]))
    return tokens(seed * 1_000_000 + i, n, shared_prefix(int(rng.integers(4)), plen))


def run_verify(path, repair: bool = False, timeout: float = 60):
    """``kvstore verify PATH [--repair]`` in a subprocess: (exit code, output)."""
    import subprocess

    cmd = kvstore_cli() + ["verify", str(path)] + (["--repair"] if repair else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, COLUMNS="200", NO_COLOR="1"))
    return p.returncode, p.stdout + p.stderr


def run_workers(script: str, args_of, n: int, timeout: float) -> list[str]:
    """Run ``n`` children ``script`` (in this folder) with ``args_of(worker)``
    side by side; their outputs, once each exited 0 within ``timeout``."""
    import subprocess
    import time

    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, os.path.join(here, script), *map(str, args_of(w))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(n)]
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError("a process sharing the store locked up") from None
            assert p.returncode == 0, f"worker exit {p.returncode} (negative: a signal): {out}{err[-3000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def fetch_whole_or_exit(store, model: str, toks, where: str) -> None:
    """For worker children: ``toks`` must be served whole and exact; else
    print "WRONG ..." and exit 3."""
    hit = store.fetch(model, toks)
    why = hit_problem(hit, toks)
    if why or hit.length != len(toks):
        print(f"WRONG {where}: hit {hit.length}/{len(toks)} {why}", flush=True)
        sys.exit(3)


def announce_and_wait(sync: str, r: int, me: int, n: int, timeout: float = 60) -> None:
    """For worker children: mark round ``r`` done by worker ``me``, then wait
    until all ``n`` workers did; exits 4 when one never does."""
    import time

    open(os.path.join(sync, f"r{r}-w{me}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(sync, f"r{r}-w{w}")) for w in range(n)):
        if time.monotonic() > deadline:
            print(f"TIMEOUT round {r}", flush=True)
            sys.exit(4)
        time.sleep(0.005)


def open_in_child(path, model: str, prompt_id: int, n: int, budget_gb: float,
                  put_prompt_id: Optional[int] = None) -> str:
    """Output of ``child_open_fetch.py`` on ``path`` (see there); the child must
    exit normally (a negative code is a signal, -7 SIGBUS)."""
    import subprocess

    args = [str(path), model, str(prompt_id), str(n), str(budget_gb)]
    if put_prompt_id is not None:
        args.append(str(put_prompt_id))
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_open_fetch.py")
    p = subprocess.run([sys.executable, child, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"opening {path} ended with {p.returncode} (negative: killed by a signal)\n" \
                              f"{p.stdout}{p.stderr[-3000:]}"
    return p.stdout


# ------------------------------------------------------------ raw LMDB access


def open_env(path, readonly: bool = False):
    """The store's LMDB environment opened directly, as another program would."""
    import lmdb

    return lmdb.open(str(path), max_dbs=8, readonly=readonly, map_size=1 << 30)


def block_key(model, toks: Sequence[int], start: int, namespace: Optional[str] = None) -> bytes:
    """Key of the block of prompt ``toks`` (of ``model``) that starts at token
    ``start``: a full block, or the prompt's last, partial one."""
    from kvstore.blocks.hashing import KeyChain, as_tokens, root_key

    t = as_tokens(toks)
    chain = KeyChain(root_key(model, namespace), t, BLOCK)
    i = start // BLOCK
    assert start % BLOCK == 0 and start < len(t)
    return chain.key(i) if start + BLOCK <= len(t) else chain.tail_key(i, len(t) - start)


def rewrite(path, key: bytes, fn, db: bytes = b"blocks") -> None:
    """Replace the value of ``key`` in sub-database ``db`` with ``fn(old value)``.
    A block's record is pointed at the new bytes, as kvstore's writer does
    (LMDB puts a replaced value elsewhere; a store reads a block where its
    record says it lies, so a record left pointing at the old bytes would
    test the old, intact block instead)."""
    from dataclasses import replace

    from kvstore.blocks.record import BlockRecord
    from kvstore.tiers.disk.residency import address, map_base

    env = open_env(path)
    try:
        handle = env.open_db(db, create=False)
        with env.begin(write=True) as txn:
            old = txn.get(key, db=handle)
            assert old is not None
            txn.put(key, fn(bytes(old)), db=handle)
        if db != b"blocks":
            return
        nodes = env.open_db(b"nodes", create=False)
        with env.begin(write=True, buffers=True) as txn:
            raw, value = txn.get(key, db=nodes), txn.get(key, db=handle)
            base = map_base(os.path.join(str(path), "data.mdb"))
            if raw is not None and base is not None:
                rec = BlockRecord.unpack(key, bytes(raw))
                offset = address(value) - base[0] if base[0] <= address(value) < base[1] else -1
                txn.put(key, replace(rec, offset=offset, nbytes=len(value)).pack(), db=nodes)
    finally:
        env.close()
