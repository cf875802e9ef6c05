"""PrefixStore contract, rule by rule."""

from __future__ import annotations

import stat
import threading

import lmdb
import mlx.core as mx
import numpy as np
import pytest

from kvstore.codec import Block, Codec
from kvstore.errors import ConfigError, KVStoreError, LayoutError, ReadOnlyError, StoreOpenError
from kvstore.hashing import KEY_BYTES, KeyChain, as_tokens, root_key
from kvstore.layers import KVLayer, Quantized, StateLayer
from kvstore.store import GB, PrefixStore
from kvstore.wire import serialize

from ._helpers import assert_hit_is, dq, kv_layers, rows, same, state_at

BS = 8
M = "test-model"


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# what one block costs in RAM: its serialized bytes (2 layers x (K, V) of [1, 1, 8, 32] float16, its
# tokens, the header, 64-byte alignment), the same bytes the disk tier stores
BLOCK_BYTES = len(serialize(Block(as_tokens(toks(BS)), kv_layers(toks(BS))), b"k" * KEY_BYTES))


@pytest.fixture
def store():
    s = PrefixStore(budget_gb=1, block_size=BS)
    yield s
    s.close()


@pytest.fixture
def ssd(tmp_path):
    opened = []

    def open_(**kw):
        kw = dict(dict(budget_gb=1, block_size=BS, ssd_path=tmp_path / "store", disk_budget_gb=1), **kw)
        s = PrefixStore(**kw)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()


def put(store, p, **kw):
    return store.put(M, p, kv_layers(p, **kw))


# --------------------------------------------------------------- dedup, hits


def test_put_stores_only_blocks_not_stored_yet(store):
    """A prompt sharing a prefix with stored ones adds only its new blocks; put
    returns how many; putting the same prompt again adds nothing."""
    a = toks(20)  # blocks [0,8) [8,16) and a tail [16,20)
    assert put(store, a) == 3
    store.flush()
    assert store.stats()["ram_blocks"] == 3
    b = a[:16] + toks(10, 5000)  # shares two full blocks, then [16,24) and a tail [24,26)
    assert put(store, b) == 2
    store.flush()
    ram = store.stats()["ram_bytes"]
    assert store.stats()["ram_blocks"] == 5 and len(store) == 5
    assert put(store, a) == 0 and put(store, b) == 0
    store.flush()
    assert store.stats()["ram_bytes"] == ram and store.stats()["puts"] == 4
    assert_hit_is(store.fetch(M, a), a, 20)
    assert_hit_is(store.fetch(M, b), b, 26)


def test_short_prompt_is_served_from_its_tail_block(store):
    """A prompt shorter than a block is kept as a tail block and served exactly,
    also inside a longer prompt and down to token granularity."""
    p = toks(5)
    assert put(store, p) == 1
    assert_hit_is(store.fetch(M, p), p, 5)
    assert_hit_is(store.fetch(M, p + [1, 2, 3, 4, 5, 6]), p + [1, 2, 3, 4, 5, 6], 5)
    assert_hit_is(store.fetch(M, p[:3]), p[:3], 3)
    assert_hit_is(store.fetch(M, p[:2] + [7, 7]), p[:2] + [7, 7], 2)
    assert not store.fetch(M, [7] + p)


def test_prompts_diverging_mid_block_hit_to_the_token(store):
    """The hit ends exactly where the prompt diverges, even inside a block,
    and carries the KV of the shared tokens."""
    a = toks(24)
    put(store, a)
    for shared in (1, 3, 8, 13, 16, 23):
        b = a[:shared] + toks(6, 9000)
        assert_hit_is(store.fetch(M, b), b, shared)
        assert store.contains(M, b) == shared


def test_limit_caps_the_hit(store):
    """``limit`` bounds the hit (``len - 1`` leaves one token for the engine to process)."""
    a = toks(24)
    put(store, a)
    assert_hit_is(store.fetch(M, a, limit=len(a) - 1), a, 23)
    assert_hit_is(store.fetch(M, a, limit=16), a, 16)
    assert_hit_is(store.fetch(M, a, limit=100), a, 24)
    assert not store.fetch(M, a, limit=0)


def test_empty_prompt_is_a_miss(store):
    """Nothing is stored for, or served to, an empty prompt."""
    assert store.put(M, [], [KVLayer(mx.zeros((1, 1, 0, 32)), mx.zeros((1, 1, 0, 32)))]) == 0
    assert not store.fetch(M, [])
    put(store, toks(8))
    assert not store.fetch(M, [])


def test_hits_report_which_tier_served_them(ssd):
    """``ram_tokens`` and ``ssd_tokens`` split the hit; blocks read from SSD are promoted to RAM."""
    a = toks(20)
    s = ssd()
    put(s, a)
    s.close()
    s = ssd()
    hit = s.fetch(M, a)
    assert (hit.ram_tokens, hit.ssd_tokens) == (0, 20)
    hit = s.fetch(M, a)
    assert (hit.ram_tokens, hit.ssd_tokens) == (20, 0)
    st = s.stats()
    assert st["hits"] == 2 and st["tokens_ssd"] == 20 and st["tokens_ram"] == 20


# ------------------------------------------------------------ recurrent state


def state_layers(p):
    return [kv_layers(p, n_layers=1)[0], state_at(p)]


def assert_state_hit(hit, p, length):
    assert hit.length == length
    if not length:
        return
    kv, state = hit.layers
    (k, v), = [(l.keys, l.values) for l in kv_layers(p[:length], n_layers=1)]
    assert same(kv.keys, k) and same(kv.values, v) and kv.start == 0
    assert isinstance(state, StateLayer)
    want = state_at(p[:length])
    assert same(state.arrays[0], want.arrays[0]) and state.arrays[1] is None


def test_state_model_hits_only_where_a_snapshot_was_taken(store):
    """A recurrent state is valid at one position: a model with state layers
    is served only at lengths where a snapshot is stored."""
    p = toks(30)
    store.put(M, p[:24], state_layers(p[:24]))  # one snapshot, at 24
    assert_state_hit(store.fetch(M, p), p, 24)
    assert_state_hit(store.fetch(M, p[:24]), p, 24)
    for n in (23, 20, 16, 9, 8):
        assert_state_hit(store.fetch(M, p[:n]), p, 0)


def test_state_snapshots_at_every_block_boundary(store):
    """Puts at block boundaries (as the generation helper does) give a
    snapshot at each, and every one of them is servable."""
    p = toks(30)
    for n in (8, 16, 24):
        store.put(M, p[:n], state_layers(p[:n]))
    for n, want in ((30, 24), (24, 24), (23, 16), (16, 16), (15, 8), (8, 8), (7, 0)):
        assert_state_hit(store.fetch(M, p[:n]), p, want)
        assert store.contains(M, p[:n]) == want


@pytest.mark.parametrize("on_ssd", [False, True])
def test_adding_a_snapshot_keeps_longer_prefixes(store, ssd, on_ssd):
    """Putting a shorter prefix later (adding a snapshot to a block stored
    without one) does not lose what was stored beyond it."""
    s = ssd() if on_ssd else store
    p = toks(24)
    s.put(M, p, state_layers(p))
    assert s.put(M, p[:16], state_layers(p[:16])) == 1  # re-encodes block [8,16) with its snapshot
    s.flush()
    assert_state_hit(s.fetch(M, p), p, 24)
    assert_state_hit(s.fetch(M, p[:20]), p, 16)
    if on_ssd:
        s.close()
        s = ssd()
        assert_state_hit(s.fetch(M, p[:20]), p, 16)
        assert_state_hit(s.fetch(M, p), p, 24)


# -------------------------------------------------------------- sliding window


def window_layers(p, window, start=0):
    """A full-attention layer and a sliding-window layer holding rows [start, len(p))."""
    full, win = kv_layers(p)
    return [full, KVLayer(win.keys[..., start:, :], win.values[..., start:, :], start, window)]


def assert_window_hit(hit, p, length, window):
    assert hit.length == length
    full, win = hit.layers
    (fk, fv), (wk, wv) = [(l.keys, l.values) for l in kv_layers(p[:length])]
    assert full.start == 0 and same(full.keys, fk) and same(full.values, fv)
    lo = max(0, length - window)
    assert win.window == window and win.start == lo and win.stop == length
    assert same(win.keys, wk[..., lo:, :]) and same(win.values, wv[..., lo:, :])


def test_sliding_window_layer_restores_only_its_window(store):
    """A sliding-window layer comes back as rows [L - window, L) only."""
    p = toks(32)
    store.put(M, p, window_layers(p, window=12))
    assert_window_hit(store.fetch(M, p), p, 32, 12)
    assert_window_hit(store.fetch(M, p[:27]), p, 27, 12)
    assert_window_hit(store.fetch(M, p[:5]), p, 5, 12)


def test_sliding_window_layer_given_only_its_window(store):
    """An engine that hands in only the window's rows (start > 0) is served
    where those rows cover [L - window, L), and never at a length that needs
    rows it did not give."""
    p = toks(32)
    store.put(M, p, window_layers(p, window=16, start=16))
    assert_window_hit(store.fetch(M, p), p, 32, 16)
    assert_window_hit(store.fetch(M, p + [1, 2, 3]), p, 32, 16)
    for n in (31, 24, 16, 8):  # would need rows before 16
        assert not store.fetch(M, p[:n])


def test_full_attention_layer_missing_rows_is_not_stored(store):
    """Rows a full-attention layer lacks can't be made up: nothing before them is stored."""
    p = toks(16)
    full, other = kv_layers(p)
    short = KVLayer(other.keys[..., 8:, :], other.values[..., 8:, :], 8)
    assert store.put(M, p, [full, short]) == 0
    assert not store.fetch(M, p)


# ------------------------------------------------------------------ quantized


def test_quantized_fetch_returns_quantized_arrays(store):
    """``quantized=(bits, group_size)`` hands back ``Quantized`` KV equal to
    quantizing the stored rows with those settings."""
    p = toks(20)
    put(store, p)
    hit = store.fetch(M, p, quantized=(8, 32))
    assert hit.length == 20
    for layer, ref in zip(hit.layers, kv_layers(p)):
        for got, x in ((layer.keys, ref.keys), (layer.values, ref.values)):
            assert isinstance(got, Quantized) and (got.bits, got.group_size) == (8, 32)
            assert got.shape == x.shape
            assert all(same(a, b) for a, b in zip(got.arrays(), mx.quantize(x, group_size=32, bits=8)))


def test_kv_bits_store_quantizes_per_key_and_value():
    """``kv_bits=(8, 4)`` keeps keys at 8 and values at 4 bits; fetch dequantizes."""
    s = PrefixStore(budget_gb=1, block_size=BS, kv_bits=(8, 4), kv_group_size=32)
    try:
        p = toks(20)
        put(s, p)
        hit = s.fetch(M, p)
        for layer, ref in zip(hit.layers, kv_layers(p)):
            values = Codec.from_bits((8, 4), 32).compress_values(ref.values)  # rotated at 4 bits by default
            assert values.rotation is not None
            assert same(layer.keys, dq(ref.keys, 8, 32)) and same(layer.values, values.dequantize())
        q = s.fetch(M, p, quantized=(8, 32)).layers[0]
        assert q.keys.bits == 8 and q.values.bits == 8
    finally:
        s.close()


def test_reopening_with_other_kv_bits_reads_old_entries(ssd):
    """Entries remember their own settings: a store reopened with other
    ``kv_bits`` serves old entries as stored and new ones in its settings."""
    a = toks(16)
    s = ssd(kv_bits=None)
    put(s, a)
    s.close()
    s = ssd(kv_bits=4, kv_group_size=32)
    assert_hit_is(s.fetch(M, a), a, 16)  # old dense entries: exact
    b = a + toks(8, 7000)
    assert put(s, b) == 1
    hit = s.fetch(M, b)
    assert hit.length == 24
    for layer, ref in zip(hit.layers, kv_layers(b)):
        assert same(layer.keys[..., :16, :], ref.keys[..., :16, :])
        new_keys = Codec.from_bits(4, 32).compress_keys(ref.keys[..., 16:, :])  # rotated at 4 bits by default
        assert same(layer.keys[..., 16:, :], new_keys.dequantize())
        new_values = Codec.from_bits(4, 32).compress_values(ref.values[..., 16:, :])  # rotated too
        assert same(layer.values[..., 16:, :], new_values.dequantize())
    s.close()
    s = ssd(kv_bits=None)
    hit = s.fetch(M, b)  # and a dense store reads the 4-bit entries back
    assert hit.length == 24
    for layer, ref in zip(hit.layers, kv_layers(b)):
        assert same(layer.values[..., 16:, :], Codec.from_bits(4, 32).compress_values(ref.values[..., 16:, :]).dequantize())


# ------------------------------------------------------------------ isolation


def test_models_do_not_share_blocks(store):
    """Identical prompts of different models never hit each other's KV."""
    p = toks(20)
    put(store, p)
    assert not store.fetch("another-model", p)
    assert not store.fetch(M.encode() + b"\0", p)
    other = [KVLayer(l.keys + 1, l.values + 1) for l in kv_layers(p)]
    assert store.put("another-model", p, other) == 3
    assert_hit_is(store.fetch(M, p), p, 20)
    assert same(store.fetch("another-model", p).layers[0].keys, other[0].keys)


def test_namespaces_do_not_share_blocks(ssd):
    """Stores of different namespaces on one SSD path never see each other's
    blocks; the same namespace does."""
    p = toks(20)
    s = ssd(namespace="tenant-a")
    put(s, p)
    s.close()
    for ns in ("tenant-b", None, ""):
        s = ssd(namespace=ns)
        assert not s.fetch(M, p) and s.contains(M, p) == 0
        s.close()
    s = ssd(namespace="tenant-a")
    assert_hit_is(s.fetch(M, p), p, 20)


# --------------------------------------------------------------------- layout


@pytest.mark.parametrize("make,match", [
    (lambda p: [KVLayer(rows(p, 0, heads=2), rows(p, 1, heads=1))], r"layer 0: keys .* and values .* must share"),
    (lambda p: [kv_layers(p)[0], KVLayer(rows(p[:-1], 0), rows(p[:-1], 1))], r"layer 1: rows cover tokens \[0, 7\) but the prompt has 8"),
    (lambda p: [KVLayer(rows(p, 0)[0], rows(p, 1)[0])], r"layer 0: keys/values must be \[batch, heads, tokens, dim\]"),
    (lambda p: [KVLayer(mx.concatenate([rows(p, 0)] * 2), mx.concatenate([rows(p, 1)] * 2))], r"batch \(1\)"),
    (lambda p: [kv_layers(p)[0], "not a layer"], r"layer 1: expected KVLayer or StateLayer, got str"),
    (lambda p: [], r"non-empty list"),
    (lambda p: [KVLayer(rows(p, 0), rows(p, 1), start=3)], r"rows cover tokens \[3, 11\)"),
])
def test_put_of_mismatched_arrays_raises_layout_error(store, make, match):
    """Arrays that do not fit together or the tokens raise LayoutError (a
    ValueError) naming the layer and the shapes; nothing is stored."""
    p = toks(8)
    with pytest.raises(LayoutError, match=match):
        store.put(M, p, make(p))
    assert len(store) == 0
    with pytest.raises(ValueError):
        store.put(M, p, make(p))


def test_bad_tokens_raise_value_error(store):
    """Token ids must be a flat sequence of signed 64-bit integers."""
    for bad in ([2**63] * 8, [-(2**63) - 1] * 8, [1.5] * 8, [[1] * 8]):
        with pytest.raises(ValueError):
            store.put(M, bad, kv_layers(toks(8)))


# mlx-lm's server keys every patch token of an image by -1 - int(sha256(url).hexdigest()[:15], 16)
IMAGE = -1 - int("9f86d081884c7d6", 16)


def test_image_prompts_with_64_bit_ids_are_stored_and_share_their_text(ssd):
    """A prompt whose image tokens carry a ~60-bit negative id is stored and
    served like any other, from RAM and after a restart from SSD; a text-only
    prompt sharing the text before the image hits that text, also where the
    two diverge inside the block holding the image (compared against the
    block's 64-bit tokens in its index record once RAM is empty)."""
    text = toks(13)  # block [0, 8) is text; block [8, 16) is text, then the image
    image = text + [IMAGE] * 6 + toks(7, 4000)
    other = text + toks(5, 9000)
    s = ssd()
    assert put(s, image) == 4
    s.flush()
    assert_hit_is(s.fetch(M, image), image, 26)
    assert_hit_is(s.fetch(M, other), other, 13)
    s.close()
    s = ssd()
    assert_hit_is(s.fetch(M, other), other, 13)
    assert_hit_is(s.fetch(M, image), image, 26)


def test_text_blocks_have_one_key_in_text_and_image_prompts(store):
    """Blocks before an image hash as they do in a text-only prompt: a stored
    text prompt serves an image prompt that starts with it, and the other way round."""
    text = toks(16)
    put(store, text)
    image = text + [IMAGE] * 4 + [5]
    assert_hit_is(store.fetch(M, image), image, 16)
    put(store, image)
    again = text + [IMAGE] * 4 + [6]
    assert_hit_is(store.fetch(M, again), again, 20)


# --------------------------------------------------------------- disk tier


def test_store_directory_is_private(tmp_path):
    """The store directory is created with mode 0o700 (parents as needed), its files 0o600."""
    path = tmp_path / "a" / "b" / "store"
    with PrefixStore(budget_gb=1, ssd_path=path, block_size=BS) as s:
        put(s, toks(8))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((path / "data.mdb").stat().st_mode) == 0o600


def test_foreign_paths_are_refused(tmp_path):
    """ssd_path must be new, empty or a kvstore store: a file or a directory
    of other files is refused with StoreOpenError, and left untouched."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreOpenError, match="is a file"):
        PrefixStore(ssd_path=f)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    with pytest.raises(StoreOpenError, match="not a kvstore store"):
        PrefixStore(ssd_path=d)
    assert f.read_text() == "x" and sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_readonly_store_serves_but_refuses_writes(ssd, tmp_path):
    """A read-only store fetches what is on disk and refuses put."""
    p = toks(20)
    s = ssd()
    put(s, p)
    s.close()
    ro = ssd(readonly=True)
    assert_hit_is(ro.fetch(M, p), p, 20)
    with pytest.raises(ReadOnlyError, match="read-only"):
        put(ro, p)
    with pytest.raises(ReadOnlyError):
        ro.clear()
    with pytest.raises(StoreOpenError):
        PrefixStore(ssd_path=tmp_path / "missing", readonly=True)


def _corrupt(path, key: bytes, how) -> None:
    env = lmdb.open(str(path), max_dbs=8, subdir=True)
    db = env.open_db(b"blocks", create=False)
    with env.begin(write=True) as txn:
        buf = bytearray(txn.get(key, db=db))
        txn.put(key, how(buf), db=db)
    env.close()


@pytest.mark.parametrize("how", [
    pytest.param(lambda b: bytes(b[:-1] + bytes([b[-1] ^ 0xFF])), id="flipped"),
    pytest.param(lambda b: bytes(b[: len(b) // 2]), id="truncated"),
    pytest.param(lambda b: b"garbage", id="garbage"),
])
def test_corrupt_block_on_disk_shortens_the_hit(ssd, tmp_path, how):
    """A bad block is a miss from there on: fetch serves the good prefix
    before it, never raises, counts it, and removes it."""
    p = toks(32)
    s = ssd()
    put(s, p)
    s.close()
    _corrupt(tmp_path / "store", KeyChain(root_key(M), as_tokens(p), BS).key(2), how)
    s = ssd()
    assert_hit_is(s.fetch(M, p), p, 16)
    assert s.stats()["corrupt_blocks"] == 1
    assert_hit_is(s.fetch(M, p), p, 16)
    assert put(s, p) == 2  # the bad block (and what hung below it) can be stored again
    s.flush()
    assert_hit_is(s.fetch(M, p), p, 32)


# ------------------------------------------------------------------ budgets


def test_ram_eviction_keeps_the_prefix_that_fits(store):
    """RAM only, a prompt larger than the budget: eviction takes leaves first,
    so the longest prefix that fits stays servable (not nothing)."""
    store.set_budget(2.5 * BLOCK_BYTES / GB)
    p = toks(40)
    put(store, p)
    store.flush()
    assert store.stats()["ram_bytes"] <= store.stats()["ram_budget"]
    assert_hit_is(store.fetch(M, p), p, 16)


def test_ram_eviction_is_least_recently_used(store):
    """The prompt fetched most recently survives; the other one is evicted."""
    a, b = toks(16, 1000), toks(16, 2000)
    put(store, a)
    put(store, b)
    store.flush()
    assert store.fetch(M, a)
    store.set_budget(2.5 * BLOCK_BYTES / GB)
    assert_hit_is(store.fetch(M, a), a, 16)
    assert not store.fetch(M, b)


def test_shrinking_the_budget_evicts_at_once(store):
    """``set_budget`` below what is held evicts immediately; 0 holds nothing."""
    for i in range(4):
        put(store, toks(16, 1000 * i))
    store.flush()
    assert store.nbytes == 8 * BLOCK_BYTES
    store.set_budget(3 * BLOCK_BYTES / GB)
    assert store.nbytes <= 3 * BLOCK_BYTES
    store.set_budget(0)
    assert store.nbytes == 0 and store.stats()["ram_blocks"] == 0


def test_no_ram_budget_with_ssd_keeps_everything_on_disk(ssd):
    """With a RAM budget of 0 every block goes to SSD, none is lost, and a
    fetch right after put (writes still in flight) already serves it all."""
    s = ssd(budget_gb=0)
    p = toks(40)
    assert put(s, p) == 5
    assert_hit_is(s.fetch(M, p), p, 40)
    s.flush()
    st = s.stats()
    assert st["ram_bytes"] == 0 and st["ssd_blocks"] == 5
    s.close()
    s = ssd(budget_gb=0)
    assert_hit_is(s.fetch(M, p), p, 40)


def test_blocks_read_from_ssd_respect_the_ram_budget(ssd):
    """Promoting blocks read from SSD never leaves RAM above its budget."""
    p = toks(40)
    s = ssd()
    put(s, p)
    s.close()
    s = ssd(budget_gb=2.5 * BLOCK_BYTES / GB)
    assert_hit_is(s.fetch(M, p), p, 40)
    st = s.stats()
    assert 0 < st["ram_bytes"] <= st["ram_budget"]


def test_clear_drops_everything(ssd):
    """``clear`` empties RAM and disk: nothing is served, now or after reopening."""
    p = toks(20)
    s = ssd()
    put(s, p)
    s.clear()
    assert not s.fetch(M, p) and len(s) == 0 and s.nbytes == 0
    s.close()
    s = ssd()
    assert not s.fetch(M, p) and len(s) == 0


# --------------------------------------------------------------- concurrency


def test_concurrent_puts_and_fetches_never_serve_wrong_kv():
    """Threads putting and fetching overlapping prompts under a small budget
    only ever see correct KV."""
    s = PrefixStore(budget_gb=6 * BLOCK_BYTES / GB, block_size=BS)
    base = toks(12)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                p = base[: rng.integers(1, 12)] + [int(x) for x in rng.integers(0, 4, size=rng.integers(0, 14))]
                if rng.random() < 0.5:
                    put(s, p)
                else:
                    hit = s.fetch(M, p)
                    assert_hit_is(hit, p, hit.length)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()
    assert not errors, errors[0]


def test_sliding_window_rows_starting_mid_block(store, ssd):
    """A window whose rows start inside a block (what an engine holds after
    decoding past its window) is served where the window is covered, from RAM
    and from disk after a restart, and never where it reaches missing rows."""
    p = toks(30)  # block size 8: rows [18, 30) start inside block [16, 24)
    on_disk = ssd()
    for s in (store, on_disk):
        s.put(M, p, window_layers(p, window=12, start=18))
        s.flush()
        assert_window_hit(s.fetch(M, p), p, 30, 12)
        assert s.fetch(M, p[:29]).length == 0  # its window would start at 17
    on_disk.close()
    reopened = ssd()
    assert_window_hit(reopened.fetch(M, p), p, 30, 12)
    assert reopened.fetch(M, p[:29]).length == 0


def test_blocks_of_other_shapes_under_one_model_key_are_a_miss_not_an_error(store):
    """A model key reused for a model of another shape must not raise into the engine."""
    a = toks(8)
    store.put(M, a, kv_layers(a, heads=1))
    b = a + toks(8, start=5000)
    wide = kv_layers(b, heads=2)
    store.put(M, b, wide)  # block 2 stored with 2 heads under block 1 with 1 head
    store.flush()
    assert store.fetch(M, b).length == 0  # never an exception, never mixed rows


def test_put_runs_in_the_caller_when_the_background_thread_is_far_behind(ssd, monkeypatch):
    """Queued work is bounded: a put that would pass the bound is done in the
    caller (counted as ``puts_inline``), and both puts are stored."""
    import kvstore.writer as W

    gate = threading.Event()
    real = W.encode

    def encode(*a):
        if threading.current_thread().name == "kvstore-writer":
            gate.wait(30)  # the background thread is stuck behind the first put
        return real(*a)

    monkeypatch.setattr(W, "encode", encode)
    s = ssd()
    s._writer.max_pending = 1
    a, b = toks(20), toks(20, start=5000)
    put(s, a)
    put(s, b)  # pending work is over the bound: done here, while the writer waits
    assert s.stats()["puts_inline"] == 1
    assert_hit_is(s.fetch(M, b), b, 20)
    gate.set()
    s.flush()
    assert_hit_is(s.fetch(M, a), a, 20)
    assert s.stats()["puts_inline"] == 1


@pytest.mark.parametrize("kwargs", [dict(budget_gb=float("nan")), dict(budget_gb=float("inf")), dict(budget_gb=-1),
                                    dict(disk_budget_gb=float("nan")), dict(block_size=0), dict(block_size=2.5),
                                    dict(kv_bits=7), dict(kv_group_size=48)])
def test_settings_out_of_range_raise_config_error(tmp_path, kwargs):
    """Every setting the store cannot use is a ConfigError (a KVStoreError and
    a ValueError) naming the setting; nothing is created on disk."""
    path = tmp_path / "store"
    with pytest.raises(ConfigError) as e:
        PrefixStore(ssd_path=path, **kwargs)
    assert isinstance(e.value, KVStoreError) and isinstance(e.value, ValueError)
    assert next(iter(kwargs)).replace("kv_", "") in str(e.value).replace("kv_", "")
    assert not path.exists()


def test_set_budget_refuses_nan(store):
    with pytest.raises(ConfigError, match="budget_gb"):
        store.set_budget(float("nan"))


def test_trim_disk_evicts_least_recently_used_leaves_first(ssd):
    """Disk eviction takes a leaf before the prefix it hangs from, and the
    least recently used leaf first; blocks still in RAM stay servable."""
    s = ssd()
    shared = toks(16)
    a, b = shared + toks(8, start=5000), shared + toks(8, start=6000)
    put(s, a)
    put(s, b)
    s.flush()
    assert s.stats()["ssd_blocks"] == 4  # 2 shared + one leaf each
    assert_hit_is(s.fetch(M, a), a, 24)  # b's leaf is now the least recently used
    assert s.trim_disk(s.stats()["ssd_bytes"] - 1) == 1
    s.trim_ram(0)
    assert s.fetch(M, b).length == 16 and s.fetch(M, a).length == 24
    assert s.trim_disk(0) == 3  # then a's leaf, then the shared prefix, child before parent
    assert s.stats()["ssd_blocks"] == 0
    s.close()
    assert ssd().fetch(M, a).length == 0


def test_a_put_of_many_batches_is_written_whole_while_encoding_overlaps(ssd, monkeypatch):
    """Batches go to the commit thread one at a time while the writer encodes
    the next: after a flush every block is on disk, and a reopened store
    serves the whole prompt exactly."""
    import kvstore.writer as writer

    monkeypatch.setattr(writer, "WRITE_BATCH", 1)  # every block its own batch and transaction
    p = toks(10 * BS)
    s = ssd()
    assert put(s, p) == 10
    s.flush()
    assert s.stats()["ssd_blocks"] == 10
    s.close()
    hit = ssd(budget_gb=0).fetch(M, p)
    assert hit.length == 10 * BS and hit.ssd_tokens == 10 * BS
    assert_hit_is(hit, p, 10 * BS)


def test_a_transaction_copies_the_first_block_before_the_writer_has_encoded_the_last(ssd, monkeypatch):
    """Blocks stream into the write transaction as they are encoded: LMDB
    has the first block of a put before the writer encodes its last one, so
    the disk is not idle while a whole batch is encoded first; the put
    still lands whole, in one transaction."""
    import kvstore.writer as writer
    from kvstore.tiers.lmdb import LmdbTier

    events: list[str] = []
    real_encode, real_store = writer.encode, LmdbTier.store

    def encode(job, node, codec):
        events.append(f"encode {node.start // BS}")
        if node.start // BS == 4:  # the last block comes after the transaction has had time to take the first
            deadline = __import__("time").monotonic() + 5
            while "copy 0" not in events and __import__("time").monotonic() < deadline:
                threading.Event().wait(0.01)
        return real_encode(job, node, codec)

    def store(self, entries, nbytes=None):
        def seen():
            for e in entries:
                events.append(f"copy {e.record.start // BS}")
                yield e
        events.append("transaction")
        return real_store(self, seen(), nbytes)

    monkeypatch.setattr(writer, "encode", encode)
    monkeypatch.setattr(LmdbTier, "store", store)
    s = ssd(budget_gb=0)
    p = toks(5 * BS)
    assert put(s, p) == 5
    s.flush()
    assert events.index("copy 0") < events.index("encode 4")
    assert events.count("transaction") == 1 and sorted(e for e in events if e.startswith("copy")) == \
        [f"copy {i}" for i in range(5)]
    s.close()
    hit = ssd(budget_gb=0).fetch(M, p)
    assert hit.ssd_tokens == 5 * BS
    assert_hit_is(hit, p, 5 * BS)


def test_a_transaction_that_outgrows_the_map_is_written_again_whole(ssd, monkeypatch):
    """A streamed transaction that fills the map part-way (no room made
    ahead) is retried with a larger map: the blocks it had taken are written
    again with the rest, and every block is on disk and exact."""
    from kvstore.tiers.lmdb import LmdbTier

    grown: list[int] = []
    real_grow = LmdbTier._grow
    monkeypatch.setattr(LmdbTier, "_make_room", lambda self, nbytes: None)
    monkeypatch.setattr(LmdbTier, "_grow", lambda self, target: (grown.append(target), real_grow(self, target))[1])
    big = dict(heads=8, dim=256)  # 64 KiB per layer per block: 40 blocks outgrow a new store's first map
    s = ssd(budget_gb=0)
    p = toks(40 * BS)
    s.put(M, p, kv_layers(p, **big))
    s.flush()
    assert grown and s.stats()["ssd_blocks"] == 40
    s.close()
    hit = ssd(budget_gb=0).fetch(M, p)
    assert hit.ssd_tokens == 40 * BS
    assert_hit_is(hit, p, 40 * BS, **big)


def test_a_write_that_fails_part_way_leaves_the_writer_free_and_ram_serving(ssd, monkeypatch):
    """When the disk write fails after taking some blocks, the writer is not
    left waiting on the transaction: the put finishes, the failure is
    counted, RAM still serves the prompt, and the next put is written."""
    from kvstore.tiers.lmdb import LmdbTier

    real_store = LmdbTier.store
    calls = []

    def store(self, entries, nbytes=None):
        calls.append(1)
        if len(calls) == 1:
            next(iter(entries))
            raise OSError(5, "Input/output error")
        return real_store(self, entries, nbytes)

    monkeypatch.setattr(LmdbTier, "store", store)
    s = ssd()
    p = toks(6 * BS)
    assert put(s, p) == 6
    s.flush(timeout=30)
    assert s._writer.pending_jobs == 0
    st = s.stats()
    assert st["write_errors"] == 1 and st["ssd_blocks"] == 0
    assert_hit_is(s.fetch(M, p), p, 6 * BS)
    q = toks(3 * BS, start=5000)
    assert put(s, q) == 3
    s.flush(timeout=30)
    assert s.stats()["ssd_blocks"] == 3


@pytest.mark.skipif(not __import__("kvstore.tiers.residency").tiers.residency.can_start_writeback(),
                    reason="Linux only")
def test_a_value_appended_without_prefill_is_never_zeroed_by_the_next_ones_prefill(tmp_path):
    """Where free pages could hold a value, nothing is prefilled for it, yet
    LMDB may append it after all (pages freed by the last transaction are not
    reusable yet): a larger value after it in the same transaction must not
    have its prefill start below it. Both come back intact."""
    from kvstore.record import BlockRecord
    from kvstore.tiers.base import Entry
    from kvstore.tiers.lmdb import LmdbTier

    def entry(i: int, n: int, fill: int) -> Entry:
        key = i.to_bytes(KEY_BYTES, "little")
        e = Entry(BlockRecord(key=key, parent=b"\0" * KEY_BYTES, root=b"\1" * KEY_BYTES, start=0, length=1,
                              tokens=np.zeros(1, np.int32), nbytes=n), None)
        e.payload = memoryview(bytes([fill]) * n)
        return e

    MiB = 1 << 20
    tier = LmdbTier(tmp_path / "s", budget_bytes=1 << 30)
    try:
        assert tier.writemap
        tier.store([entry(i, 2 * MiB, 7) for i in range(1, 4)], 6 * MiB)
        tier.remove([i.to_bytes(KEY_BYTES, "little") for i in range(1, 4)])  # ~6 MiB of free pages
        small, big = entry(10, MiB, 0xAB), entry(11, 8 * MiB, 0xCD)
        tier.store(iter([small, big]), 9 * MiB)
        with tier.reader() as txn:
            assert bytes(tier.payload(txn, small.key)) == bytes([0xAB]) * MiB
            assert bytes(tier.payload(txn, big.key)) == bytes([0xCD]) * 8 * MiB
    finally:
        tier.close()


def test_where_no_commit_thread_can_start_the_writer_writes_the_blocks_itself(ssd, monkeypatch):
    """An exiting interpreter (Python 3.12+) refuses new threads: a put whose
    commit thread cannot start is still written whole, by the writer."""
    import kvstore.writer as writer

    real_start = threading.Thread.start

    def start(self):
        if self.name == "kvstore-commit":
            raise RuntimeError("can't create new thread at interpreter shutdown")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(writer, "WRITE_BATCH", 1)  # several transactions
    s = ssd(budget_gb=0)
    p = toks(6 * BS)
    assert put(s, p) == 6
    s.flush(timeout=30)
    assert s._writer.pending_jobs == 0 and s.stats()["ssd_blocks"] == 6
    assert_hit_is(s.fetch(M, p), p, 6 * BS)


def test_where_no_thread_can_start_a_put_is_written_in_the_callers_thread(ssd, monkeypatch):
    """An exiting interpreter (Python 3.12+) refuses new threads: a put (and a
    new model's description) then runs in the caller, written whole, with no
    error raised into the engine and nothing left pending."""
    from kvstore.hashing import root_key

    s = ssd(budget_gb=0)
    def start(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", start)
    p = toks(4 * BS)
    assert put(s, p) == 4
    assert s.stats()["ssd_blocks"] == 4 and s._writer.pending_bytes == 0
    assert root_key(M, s.namespace) in s._persist.disk.models()
    monkeypatch.undo()
    assert_hit_is(s.fetch(M, p), p, 4 * BS)


def test_an_interrupt_while_the_engine_thread_encodes_leaves_no_transaction_open(ssd, monkeypatch):
    """A put run in the engine's thread (the writer's queue over its bound)
    that is interrupted (Ctrl-C) part-way: the interrupt reaches the engine
    once the blocks handed over are written, the others are stored by the
    next put, and the store closes (no write transaction left waiting for
    blocks that never come)."""
    import kvstore.writer as writer

    real_encode = writer.encode

    def encode(job, node, codec):
        if node.start >= 3 * BS and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        return real_encode(job, node, codec)

    monkeypatch.setattr(writer, "encode", encode)
    s = ssd(budget_gb=0)
    monkeypatch.setattr(s._writer, "submit", s._writer.run)  # the inline path
    p = toks(6 * BS)
    with pytest.raises(KeyboardInterrupt):
        put(s, p)
    monkeypatch.undo()
    assert s.stats()["ssd_blocks"] == 3  # (written by the time the interrupt reaches the engine)
    assert put(s, p) == 3  # the blocks never encoded are not taken as stored
    s.flush(timeout=30)
    assert s.stats()["ssd_blocks"] == 6
    assert_hit_is(s.fetch(M, p), p, 6 * BS)
    done = threading.Event()
    threading.Thread(target=lambda: (s.close(), done.set()), daemon=True).start()
    assert done.wait(30)


def test_put_leaves_every_disk_write_to_the_background_threads(ssd, monkeypatch):
    """A put never waits on a disk transaction (an fsync): not for its blocks
    and not for the first description of a new model, which still lands."""
    from kvstore.tiers.lmdb import LmdbTier

    writers: list[str] = []
    real = LmdbTier.write

    def write(self, *a, **kw):
        writers.append(threading.current_thread().name)
        return real(self, *a, **kw)

    monkeypatch.setattr(LmdbTier, "write", write)
    s = ssd()
    writers.clear()  # (opening the store writes its settings)
    put(s, toks(3 * BS))
    put(s, toks(3 * BS))  # nothing new
    s.flush()
    assert writers and threading.current_thread().name not in writers
    assert root_key(M, s.namespace) in s._persist.disk.models()


def test_a_writable_store_dropped_unclosed_leaves_its_path_free(tmp_path):
    """Opening a store starts no thread that keeps it alive: one dropped
    without close() (and never written to) is collected, and its path opens
    again in the same process."""
    import gc

    s = PrefixStore(budget_gb=1, block_size=BS, ssd_path=tmp_path / "store")
    del s
    gc.collect()
    again = PrefixStore(budget_gb=1, block_size=BS, ssd_path=tmp_path / "store")
    again.close()


def test_a_disk_only_store_serializes_into_the_buffers_it_wrote_before(ssd):
    """Blocks written through (no RAM to keep them) hand their bytes back,
    and the next put's blocks are serialized into them: no fresh memory (page
    faults) per block in the steady state, and every block still exact."""
    from kvstore import buffers

    big = dict(n_layers=2, heads=16, dim=1024)  # 1 MiB blocks: the size buffers are kept for
    s = ssd(budget_gb=0)
    a, b = toks(4 * BS), toks(4 * BS, start=5000)
    s.put(M, a, kv_layers(a, **big))
    s.flush()
    handed_back = {r.ctypes.data for r in buffers._waiting}
    assert handed_back
    taken: list[int] = []
    real = buffers.take

    def take(n):
        out = real(n)
        taken.append(out.ctypes.data)
        return out

    try:
        buffers.take = take
        s.put(M, b, kv_layers(b, **big))
        s.flush()
    finally:
        buffers.take = real
    assert handed_back & set(taken)
    for p in (a, b):
        hit = s.fetch(M, p)
        assert hit.ssd_tokens == len(p)
        assert_hit_is(hit, p, len(p), **big)


def test_a_put_keeps_the_kv_it_was_given_when_the_engine_writes_its_buffer_after(ssd, monkeypatch):
    """The writer serializes straight from the engine's buffers, after put
    has returned; an engine that writes into those buffers meanwhile (mlx-lm
    fills its cache in place) does not change what is stored."""
    import kvstore.writer as writer

    p = toks(3 * BS)
    layers = kv_layers(p)
    engine = [[l.keys, l.values] for l in layers]  # the engine's buffers, 1 spare row per layer
    engine = [[mx.concatenate([t, mx.zeros_like(t[..., :1, :])], axis=2) for t in kv] for kv in engine]
    given = [KVLayer(k[..., : len(p), :], v[..., : len(p), :]) for k, v in engine]
    mx.eval([t for kv in engine for t in kv] + [t for l in given for t in (l.keys, l.values)])
    wrote = threading.Event()
    real = writer.encode

    def encode(*a):
        assert wrote.wait(10)
        return real(*a)

    monkeypatch.setattr(writer, "encode", encode)
    s = ssd(budget_gb=0)
    s.put(M, p, given)
    for kv in engine:  # the engine overwrites rows of the prompt (a trim and a new suffix)
        for t in kv:
            t[..., 2:, :] = mx.full(t[..., 2:, :].shape, 7.0, t.dtype)
        mx.eval(kv)
    wrote.set()
    s.flush()
    assert_hit_is(s.fetch(M, p), p, len(p))


@pytest.mark.skipif(not __import__("kvstore.tiers.residency").tiers.residency.can_start_writeback(),
                    reason="sync_file_range is Linux-only")
def test_each_block_starts_its_write_out_where_its_bytes_lie_in_the_file(ssd, monkeypatch):
    """The writer asks the kernel to write each value out as soon as it is in
    the map, at its real place in data.mdb (what lies there is the block)."""
    import os

    import kvstore.tiers.lmdb as lmdb_tier

    asked: list[tuple[int, int]] = []
    real = lmdb_tier.start_writeback
    monkeypatch.setattr(lmdb_tier, "start_writeback", lambda fd, off, n: (asked.append((off, n)), real(fd, off, n)))
    s = ssd(budget_gb=0)
    p = toks(5 * BS)
    assert put(s, p) == 5
    s.flush()
    assert len(asked) == 5
    disk = s._persist.disk
    fd = os.open(disk.path / "data.mdb", os.O_RDONLY)
    try:
        on_file = {os.pread(fd, n, off) for off, n in asked}
    finally:
        os.close(fd)
    with disk.env.begin(db=disk.dbs[b"blocks"]) as txn:
        stored = {bytes(v) for _, v in txn.cursor()}
    assert on_file == stored


@pytest.mark.skipif(not __import__("kvstore.tiers.residency").tiers.residency.can_start_writeback(),
                    reason="Linux only")
def test_the_pages_a_write_takes_are_prefilled_only_where_lmdb_appends(ssd, monkeypatch):
    """A store with no free pages gets its values past the last page in use:
    those pages' cache is put in place before the copy (zeros written over
    unused pages), and every value lies inside them. With free pages (after
    an eviction) LMDB may reuse them instead, and nothing is prefilled."""
    import kvstore.tiers.lmdb as lmdb_tier

    big = dict(heads=4, dim=256)  # 64 KiB blocks: values on pages of their own
    s = ssd(budget_gb=0)
    disk = s._persist.disk
    ranges: list[tuple[int, int]] = []  # file offsets
    real = lmdb_tier.prefill

    def prefill(fd, off, n):
        ranges.append((off, n))
        return real(fd, off, n)

    monkeypatch.setattr(lmdb_tier, "prefill", prefill)
    p = toks(6 * BS)
    s.put(M, p, kv_layers(p, **big))
    s.flush()
    with disk.reader() as txn:
        spans = [(disk.offset_of(v), len(v)) for _, v in txn.cursor(db=disk.dbs[b"blocks"])]
    assert len(spans) == 6 and ranges
    assert all(any(a <= off and off + n <= a + m for a, m in ranges) for off, n in spans)
    assert s.trim_disk(s.stats()["ssd_bytes"] // 2) >= 1  # frees pages inside the file
    ranges.clear()
    q = toks(3 * BS, start=9000)
    s.put(M, q, kv_layers(q, **big))
    s.flush()
    assert ranges == []
    assert_hit_is(s.fetch(M, q), q, len(q), **big)


def test_a_disk_hit_reads_no_block_whole_before_copying_it(ssd, monkeypatch):
    """Disk blocks are copied straight out of the map where their records
    say they lie: no block is read whole first (py-lmdb's get reads every
    page of a value before it returns, so a cold hit read all its blocks
    before copying the first)."""
    from kvstore.tiers.lmdb import LmdbTier

    big = dict(heads=4, dim=256)  # values on pages of their own
    p = toks(4 * BS)
    s = ssd()
    s.put(M, p, kv_layers(p, **big))
    s.flush()
    s.close()
    s = ssd(budget_gb=0)
    got: list[bytes] = []
    real = LmdbTier.payload
    monkeypatch.setattr(LmdbTier, "payload", lambda self, txn, key: (got.append(key), real(self, txn, key))[1])
    hit = s.fetch(M, p)
    assert hit.ssd_tokens == len(p) and got == []
    assert_hit_is(hit, p, len(p), **big)


def test_a_record_pointing_at_other_bytes_falls_back_to_lmdb(ssd):
    """Where a record's offset holds another block's bytes (a store copied
    elsewhere, a record from another writer), the block is read through
    LMDB: the hit is whole and exact, and nothing is dropped as corrupt."""
    from dataclasses import replace

    from kvstore.record import BlockRecord

    big = dict(heads=4, dim=256)
    p = toks(3 * BS)
    s = ssd()
    s.put(M, p, kv_layers(p, **big))
    s.flush()
    disk = s._persist.disk
    with disk.env.begin(write=True) as txn:
        recs = [BlockRecord.unpack(bytes(k), bytes(v)) for k, v in txn.cursor(db=disk.dbs[b"nodes"])]
        offsets = [r.offset for r in recs]
        assert all(o >= 0 for o in offsets)
        for r, o in zip(recs, offsets[1:] + offsets[:1]):  # each record points at the next block's bytes
            txn.put(r.key, replace(r, offset=o).pack(), db=disk.dbs[b"nodes"])
    s.close()
    s = ssd(budget_gb=0)
    hit = s.fetch(M, p)
    assert hit.ssd_tokens == len(p)
    assert_hit_is(hit, p, len(p), **big)
    assert s.stats()["ssd_blocks"] == 3


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_quantized_together_are_the_rows_quantized_block_by_block(tmp_path, monkeypatch, bits):
    """The writer quantizes (and rotates) many rows of a layer at once and
    cuts the blocks from them; each block's stored bytes are exactly those of
    quantizing the block alone."""
    import kvstore.writer as writer

    p = toks(5 * BS)
    layers = kv_layers(p, heads=2, dim=64)
    stored = {}
    for rows in (BS, 3 * BS):  # block by block; three blocks at once (a chunk ending mid-prompt)
        monkeypatch.setattr(writer, "COMPRESS_ROWS", rows)
        path = tmp_path / f"s{rows}"
        with PrefixStore(budget_gb=0, block_size=BS, ssd_path=path, kv_bits=bits, rotate_keys=True) as s:
            assert s.put(M, p, layers) == 5
        with PrefixStore(budget_gb=0, block_size=BS, ssd_path=path, kv_bits=bits, rotate_keys=True) as s:
            disk = s._persist.disk
            with disk.env.begin(db=disk.dbs[b"blocks"]) as txn:
                stored[rows] = {bytes(k): bytes(v) for k, v in txn.cursor()}
    assert len(stored[BS]) == 5 and stored[BS] == stored[3 * BS]
