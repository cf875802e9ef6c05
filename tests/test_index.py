"""Radix index and block keys.

The index is checked against a naive model (a set of token-tuple prefixes per
model); keys are checked for stability across processes, isolation between
models and namespaces, and chaining."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.blocks.hashing import KeyChain, as_tokens, chain_key, root_key
from kvstore.state.index import RadixIndex

SETTINGS = settings(max_examples=40, deadline=None)
ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ index model

MODELS = ("model-a", "model-b")
paths = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(tuple)


def n_full(chain: KeyChain) -> int:
    """Whole blocks of a chain's tokens."""
    return len(chain.tokens) // chain.block_size


class IndexModel(RuleBasedStateMachine):
    """Each block holds one token, so a node at depth d covers tokens [d-1, d).
    The model is the set of indexed token prefixes (prefix-closed) per model."""

    def __init__(self):
        super().__init__()
        self.index = RadixIndex()
        self.model: dict[str, set[tuple]] = {m: set() for m in MODELS}
        self.pins: dict[tuple[str, tuple], int] = {}

    def keys(self, m: str, path: tuple) -> list[bytes]:
        chain = KeyChain(root_key(m), as_tokens(path), 1)
        return [chain.key(i) for i in range(len(path))]

    def node(self, m: str, path: tuple):
        return self.index.get(self.keys(m, path)[-1])

    def root(self, m: str):
        return self.index.root(root_key(m))

    @rule(m=st.sampled_from(MODELS), path=paths)
    def insert(self, m, path):
        """Insert every block of ``path`` in order; existing blocks are returned as they are."""
        parent = self.root(m)
        for d, key in enumerate(self.keys(m, path)):
            before = self.index.get(key)
            node = self.index.add(parent, key, d, 1, first=path[d])
            assert before is None or node is before
            assert node.parent is parent and node.start == d and node.end == d + 1
            self.model[m].add(path[: d + 1])
            parent = node

    @rule(m=st.sampled_from(MODELS), path=paths)
    def insert_run(self, m, path):
        """``add_run`` indexes a path's blocks in one call, as ``insert`` does block by block."""
        nodes = self.index.add_run(self.root(m), self.keys(m, path), 0, 1, list(path))
        assert [n.key for n in nodes] == self.keys(m, path)
        assert [(n.start, n.end, n.first) for n in nodes] == [(d, d + 1, t) for d, t in enumerate(path)]
        assert nodes[0].parent is self.root(m) and all(b.parent is a for a, b in zip(nodes, nodes[1:]))
        self.model[m].update(path[: d + 1] for d in range(len(path)))

    @rule(m=st.sampled_from(MODELS), path=paths)
    def match(self, m, path):
        """``match`` returns the longest indexed prefix, block by block."""
        want = max((d for d in range(len(path) + 1) if path[:d] in self.model[m] or d == 0))
        result = self.index.match(self.root(m), self.keys(m, path))
        assert result.length == want
        assert [n.key for n in result.nodes] == self.keys(m, path)[:want]
        if want:
            assert result.last.path() == result.nodes

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def remove_subtree(self, data):
        """``remove`` drops exactly the node and everything below it."""
        m = data.draw(st.sampled_from([m for m in MODELS if self.model[m]]))
        path = data.draw(st.sampled_from(sorted(self.model[m])))
        gone = {p for p in self.model[m] if p[: len(path)] == path}
        node = self.node(m, path)
        dropped = self.index.remove(node)
        assert {n.key for n in dropped} == {self.keys(m, p)[-1] for p in gone}
        self.model[m] -= gone
        for p in gone:
            self.pins.pop((m, p), None)
        with pytest.raises(KeyError):  # a removed block cannot take children
            self.index.add(node, b"x" * 16, node.end, 1)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data(), pin=st.booleans())
    def pin_unpin(self, data, pin):
        """Pins count per block, along a whole path at once."""
        m = data.draw(st.sampled_from([m for m in MODELS if self.model[m]]))
        path = data.draw(st.sampled_from(sorted(self.model[m])))
        nodes = self.node(m, path).path()
        prefixes = [path[: d + 1] for d in range(len(path))]
        if pin:
            RadixIndex.pin(nodes)
            for p in prefixes:
                self.pins[(m, p)] = self.pins.get((m, p), 0) + 1
        elif all(self.pins.get((m, p), 0) > 0 for p in prefixes):
            RadixIndex.unpin(nodes)
            for p in prefixes:
                self.pins[(m, p)] -= 1

    @invariant()
    def agrees_with_model(self):
        """len, iteration, membership, leaves and pins agree with the model."""
        expect = {self.keys(m, p)[-1]: (m, p) for m in MODELS for p in self.model[m]}
        assert len(self.index) == len(expect)
        assert {n.key for n in self.index} == set(expect)
        for key, (m, p) in expect.items():
            assert key in self.index
            node = self.index.get(key)
            assert node.end == len(p)
            assert (not node.children) == (not any(q[: len(p)] == p and len(q) > len(p) for q in self.model[m]))
            assert node.pins == self.pins.get((m, p), 0)
        leaves = sum(1 for m in MODELS for p in self.model[m]
                     if not any(q[: len(p)] == p and len(q) > len(p) for q in self.model[m]))
        assert self.index.leaves == leaves


TestIndexAgreesWithModel = IndexModel.TestCase
TestIndexAgreesWithModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_add_checks_parent_and_position():
    """A block must start where its parent ends, under an indexed parent."""
    idx = RadixIndex()
    root = idx.root(root_key("m"))
    a = idx.add(root, b"a" * 16, 0, 4)
    with pytest.raises(ValueError):
        idx.add(a, b"b" * 16, 5, 4)
    with pytest.raises(ValueError):
        idx.add_run(a, [b"b" * 16], 5, 4, [0])
    b = idx.add(a, b"b" * 16, 4, 4)
    idx.remove(a)
    with pytest.raises(KeyError):
        idx.add(b, b"c" * 16, 8, 4)
    with pytest.raises(KeyError):
        idx.add_run(b, [b"c" * 16], 8, 4, [0])
    assert len(idx) == 0 and idx.match(root, [b"a" * 16]).length == 0


# ------------------------------------------------------------------------ keys

_KEYS_SNIPPET = """
import json, sys
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
out = []
for model, ns, toks in json.loads(sys.argv[1]):
    c = KeyChain(root_key(model, ns), as_tokens(toks), 4)
    n = len(toks) // 4
    out.append([root_key(model, ns).hex()] + [c.key(i).hex() for i in range(n)] + [c.tail_key(n, len(toks) % 4).hex()])
print(json.dumps(out))
"""

CASES = [["m", None, list(range(10))], ["m", "tenant", [5, 6, 7, 8, 9]], ["other/model", None, [2**31 - 1] * 9]]


def keys_in_process(seed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _KEYS_SNIPPET, json.dumps(CASES)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_keys_are_stable_across_processes():
    """Keys depend only on explicit bytes: processes with different hash seeds agree."""
    assert keys_in_process("1") == keys_in_process("4242")


def test_keys_are_pinned():
    """Keys are part of the on-disk format: block i's key is
    xxh3_128(key of block i-1 || its tokens as little-endian int32), from a
    root fingerprinting the model, and these exact values must never change."""
    import struct

    import xxhash

    root = xxhash.xxh3_128_digest(b"kvstore-root-v1\x00" + struct.pack("<I", 1) + b"m")
    block0 = xxhash.xxh3_128_digest(root + struct.pack("<4i", 1, 2, 3, 4))
    tail = xxhash.xxh3_128_digest(block0 + struct.pack("<i", 5))
    c = KeyChain(root_key("m"), as_tokens([1, 2, 3, 4, 5]), 4)
    assert (root_key("m"), c.key(0), c.tail_key(1, 1)) == (root, block0, tail)
    assert root.hex() == "6828c6d6487563379802331a43e5ccec"
    assert block0.hex() == "00d952903a1311374743d25029f0527f"
    assert tail.hex() == "2303607334d6415859b47dcc7c0236d7"


@SETTINGS
@given(a=st.tuples(st.text(max_size=6), st.none() | st.text(max_size=6)),
       b=st.tuples(st.text(max_size=6), st.none() | st.text(max_size=6)))
def test_root_keys_separate_models_and_namespaces(a, b):
    """Different (model, namespace) pairs never share a root key (no namespace
    differs from the empty namespace; concatenations do not collide). An
    empty model key is refused (every model has a name)."""
    assume(a != b and a[0] and b[0])
    assert root_key(*a) != root_key(*b)


def test_root_key_accepts_bytes_and_str_alike():
    """A model key given as str or as its UTF-8 bytes is the same model."""
    assert root_key("modèle") == root_key("modèle".encode())


@SETTINGS
@given(toks=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), bs=st.integers(1, 8), data=st.data())
def test_keys_are_chained(toks, bs, data):
    """Changing token j changes the keys of block j // bs and every later block,
    and no earlier one."""
    j = data.draw(st.integers(0, len(toks) - 1))
    other = list(toks)
    other[j] = (toks[j] + data.draw(st.integers(1, 1000))) % 2**31
    a = KeyChain(root_key("m"), as_tokens(toks), bs)
    b = KeyChain(root_key("m"), as_tokens(other), bs)
    for i in range(n_full(a)):
        assert (a.key(i) == b.key(i)) == (i < j // bs)
    assert n_full(a) == n_full(b)


@SETTINGS
@given(toks=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), bs=st.integers(1, 8))
def test_tail_keys_extend_the_chain(toks, bs):
    """A partial block's key hashes its tokens onto its parent's key; a full
    length tail key is the block key; tails of different lengths differ."""
    c = KeyChain(root_key("m"), as_tokens(toks), bs)
    for i in range(n_full(c)):
        assert c.tail_key(i, bs) == c.key(i) == chain_key(c.parent(i), as_tokens(toks[i * bs:(i + 1) * bs]))
    i = n_full(c)
    tails = {c.tail_key(i, n) for n in range(1, len(toks) - i * bs + 1)}
    assert len(tails) == len(toks) - i * bs


@SETTINGS
@given(toks=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(0, 2**31 - 1), min_size=1, max_size=40),
       bs=st.integers(1, 8))
def test_keys_asked_for_at_once_equal_keys_asked_for_in_turn(toks, bs):
    """A put hashes every block in one go (``key(last)`` first); the keys are
    the chain's, block by block, for int32 and int64 prompts alike."""
    one_go, in_turn = (KeyChain(root_key("m"), as_tokens(toks), bs) for _ in range(2))
    if n_full(one_go):
        one_go.key(n_full(one_go) - 1)
    parent = root_key("m")
    for i in range(n_full(in_turn)):
        parent = chain_key(parent, as_tokens(toks[i * bs:(i + 1) * bs]))
        assert one_go.key(i) == in_turn.key(i) == parent


def test_keys_of_other_models_and_namespaces_differ():
    """The same tokens hash differently under another model or namespace."""
    t = as_tokens(range(8))
    keys = {KeyChain(root_key(m, ns), t, 4).key(1) for m in ("a", "b") for ns in (None, "x", "y")}
    assert len(keys) == 6


def test_as_tokens_normalizes_and_validates():
    """Lists and any integer array give the same tokens: int32 when every id
    fits (negative ones too), else int64; what signed 64 bits cannot hold,
    floats, bools and nested sequences are refused."""
    ref = as_tokens([1, 2, 3])
    assert ref.dtype == np.dtype("<i4")
    for same in (np.array([1, 2, 3], np.int64), np.array([1, 2, 3], np.uint16), (1, 2, 3)):
        assert np.array_equal(as_tokens(same), ref) and as_tokens(same).dtype == np.dtype("<i4")
    assert len(as_tokens([])) == 0
    assert as_tokens([-1, 2**31 - 1, -(2**31)]).dtype == np.dtype("<i4")
    for wide in ([2**31], [-(2**31) - 1], [5, IMAGE_ID], [2**63 - 1], np.array([2**40], np.uint64)):
        got = as_tokens(wide)
        assert got.dtype == np.dtype("<i8") and got.tolist() == list(map(int, wide))
    assert as_tokens([np.int64(7), np.uint8(8)]).tolist() == [7, 8]  # numpy ints in a list too
    for bad in ([2**63], [-(2**63) - 1], [1, 2**70], [1.5], [True, False], [[1, 2]], ["a"],
                [1, 2.5], [1, [2]], [1, "a"], [1, None]):  # (a first int does not vouch for the rest)
        with pytest.raises(ValueError):
            as_tokens(bad)


# an image id as mlx-lm's server makes them: -1 - int(sha256(url).hexdigest()[:15], 16)
IMAGE_ID = -1 - int("9f86d081884c7d6", 16)


@SETTINGS
@given(text=st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=24),
       ids=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=8), bs=st.integers(1, 8))
def test_block_keys_do_not_depend_on_the_prompts_width(text, ids, bs):
    """The blocks of a prompt hash the same in a text-only prompt (int32) and
    in a prompt that goes on with 64-bit ids (int64): a system prompt before
    an image has the keys it has without the image."""
    assume(any(not -(2**31) <= i < 2**31 for i in ids))
    narrow = KeyChain(root_key("m"), as_tokens(text), bs)
    wide = KeyChain(root_key("m"), as_tokens(text + ids), bs)
    assert wide.tokens.dtype == np.dtype("<i8")
    for i in range(n_full(narrow)):
        assert wide.key(i) == narrow.key(i)
    n = len(text) % bs
    if n:
        assert wide.tail_key(n_full(narrow), n) == narrow.tail_key(n_full(narrow), n)


def test_wide_blocks_hash_tagged_int64_bytes():
    """A block with an id outside int32 hashes as a tag byte then little-endian
    int64 (pinned: part of the on-disk format), so it never shares bytes with a
    block of int32 ids: here two int32 ids whose bytes equal one int64 id."""
    import struct

    import xxhash

    parent = root_key("m")
    wide = as_tokens([IMAGE_ID, 7])
    assert chain_key(parent, wide) == xxhash.xxh3_128_digest(parent + b"\x01" + struct.pack("<2q", IMAGE_ID, 7))
    lo, hi = 5, 1 << 20
    one = as_tokens([(hi << 32) | lo])
    two = as_tokens([lo, hi])
    assert one.tobytes() == two.tobytes() and one.dtype != two.dtype
    assert chain_key(parent, one) != chain_key(parent, two)
