"""Hostile and mistaken input: every one gets a ``KVStoreError`` subclass
that names what is wrong, and loses nothing already stored.

This table is docs/errors.md's; each row is one case below.

=============================================  ===================  ==========================
input                                          error                also a
=============================================  ===================  ==========================
tokens of floats, bools, str, None, nested     ``InputError``       ``ValueError``, ``TypeError``
token ids outside signed 64 bits ([2**63, 0])  ``InputError``       ``ValueError``, ``TypeError``
``model_key`` None, "", an int                 ``InputError``       ``ValueError``, ``TypeError``
``limit`` "5", -1, 2.0                         ``InputError``       ``ValueError``, ``TypeError``
``trim_ram``/``trim_disk`` "5" or -1           ``InputError``       ``ValueError``, ``TypeError``
``register_model`` info not a dict             ``InputError``       ``ValueError``, ``TypeError``
layers [] / not layers / shapes that disagree  ``LayoutError``      ``ValueError``
``rows=`` past the arrays' rows, not an int    ``LayoutError``      ``ValueError``
KV of int32, float64 (mlx or numpy), lists     ``LayoutError``      ``ValueError``
``kv_bits`` "8", 7, (8,); ``kv_group_size`` 48 ``ConfigError``      ``ValueError``
``block_size`` 0, 2.5, 2**40                   ``ConfigError``      ``ValueError``
budgets "4", NaN, inf, -1                      ``ConfigError``      ``ValueError``
``ssd_path`` "" (the working directory), 5     ``ConfigError``      ``ValueError``
``namespace`` 5 or bytes, ``fetch_policy`` "x" ``ConfigError``      ``ValueError``
``remote`` not a redis:// / rediss:// / unix:  ``RemoteConfigError``  ``ConfigError``
``ssd_path`` a file, a folder of other files,  ``StoreOpenError``
another program's LMDB, a newer format
``ssd_path`` this user cannot enter or write   ``StoreOpenError``   (tests/test_open.py)
any call after ``close()``                     ``StoreClosedError``
``put``/``clear`` on ``readonly=True``         ``ReadOnlyError``
=============================================  ===================  ==========================
"""

from __future__ import annotations

import math

import lmdb
import mlx.core as mx
import numpy as np
import pytest

from kvstore import (ConfigError, InputError, KVStoreError, LayoutError, PrefixStore, ReadOnlyError,
                     RemoteConfigError, StoreClosedError, StoreOpenError)
from kvstore.config import StoreConfig
from kvstore.blocks.layers import KVLayer

from ._helpers import assert_hit_is, kv_layers

BS = 8
M = "test-model"
P = list(range(1000, 1000 + 2 * BS))


@pytest.fixture
def store(tmp_path):
    """A store holding ``P``: every case must leave it holding ``P``."""
    s = PrefixStore(ssd_path=tmp_path / "store", block_size=BS)
    s.put(M, P, kv_layers(P))
    s.flush()
    yield s
    s.close()


def _calls_on_a_store():
    good = kv_layers(P)
    return [
        ("float tokens", lambda s: s.put(M, [1.5] * BS, good[:1]), InputError, "flat sequence of ints"),
        ("bool tokens", lambda s: s.fetch(M, [True] * BS), InputError, "flat sequence of ints"),
        ("str tokens", lambda s: s.fetch(M, "hello"), InputError, "got str"),
        ("None tokens", lambda s: s.fetch(M, None), InputError, "got NoneType"),
        ("ragged tokens", lambda s: s.fetch(M, [[1, 2], [3]]), InputError, "flat sequence of ints"),
        ("2-d tokens", lambda s: s.contains(M, [[1, 2], [3, 4]]), InputError, "shape"),
        ("ids past 64 bits", lambda s: s.put(M, [2**63, 0], good[:1]), InputError, "signed 64 bits"),
        ("negative ids past 64 bits", lambda s: s.fetch(M, [-(2**63) - 1, 0]), InputError, "signed 64 bits"),
        ("a float array of tokens", lambda s: s.fetch(M, np.ones(4)), InputError, "float64"),
        ("model_key None", lambda s: s.put(None, P, good), InputError, "model_key"),
        ("model_key ''", lambda s: s.fetch("", P), InputError, "model_key"),
        ("model_key int", lambda s: s.contains(5, P), InputError, "model_key"),
        ("limit '5'", lambda s: s.fetch(M, P, limit="5"), InputError, "limit"),
        ("limit -1", lambda s: s.fetch(M, P, limit=-1), InputError, "limit"),
        ("limit 2.0", lambda s: s.fetch(M, P, limit=2.0), InputError, "limit"),
        ("trim_ram '5'", lambda s: s.trim_ram("5"), InputError, "n_bytes"),
        ("trim_disk -1", lambda s: s.trim_disk(-1), InputError, "n_bytes"),
        ("register_model info str", lambda s: s.register_model(M, "llama"), InputError, "info"),
        ("no layers", lambda s: s.put(M, P, []), LayoutError, "non-empty list"),
        ("a layer that is not one", lambda s: s.put(M, P, ["kv"]), LayoutError, "expected KVLayer"),
        ("rows that do not fit the tokens", lambda s: s.put(M, P + [1], good), LayoutError, "rows cover"),
        ("rows= short of the tokens", lambda s: s.put(M, P, [KVLayer(l.keys, l.values, rows=len(P) - 1)
                                                             for l in good]), LayoutError, "rows cover"),
        ("rows= past the arrays", lambda s: s.put(M, P + [1], [KVLayer(l.keys, l.values, rows=len(P) + 1)
                                                               for l in good]), LayoutError, "arrays hold 16 rows"),
        ("rows= not an int", lambda s: s.put(M, P, [KVLayer(l.keys, l.values, rows=True) for l in good]),
         LayoutError, "rows an int or None"),
        ("int32 KV", lambda s: s.put(M, P, [KVLayer(l.keys.astype(mx.int32), l.values.astype(mx.int32))
                                          for l in good]), LayoutError, "int32 cannot be stored"),
        ("numpy float64 KV", lambda s: s.put(M, P, [KVLayer(np.zeros(l.keys.shape), np.zeros(l.values.shape))
                                                 for l in good]), LayoutError, "float64"),
        ("KV as lists", lambda s: s.put(M, P, [KVLayer(l.keys.tolist(), l.values.tolist()) for l in good]),
         LayoutError, "expected an mlx array"),
    ]


@pytest.mark.parametrize("what,call,error,says", _calls_on_a_store(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_bad_argument_gets_its_error_and_loses_nothing(store, what, call, error, says):
    with pytest.raises(error, match=says) as e:
        call(store)
    assert isinstance(e.value, KVStoreError)
    if error is InputError:
        assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
    store.flush()
    assert_hit_is(store.fetch(M, P), P, len(P))
    assert len(store) == 2


@pytest.mark.parametrize("kwargs,says", [
    (dict(kv_bits="8"), "kv_bits"), (dict(kv_bits=7), "kv_bits"), (dict(kv_bits=(8,)), "kv_bits"),
    (dict(kv_bits=True), "kv_bits"), (dict(kv_group_size="64"), "kv_group_size"),
    (dict(block_size=2**40), "block_size"), (dict(block_size="256"), "block_size"),
    (dict(budget_gb="4"), "budget_gb"), (dict(budget_gb=math.inf), "budget_gb"),
    (dict(disk_budget_gb=-1), "disk_budget_gb"), (dict(ssd_path=""), "ssd_path"), (dict(ssd_path=5), "ssd_path"),
    (dict(namespace=b"tenant"), "namespace"), (dict(namespace=5), "namespace"), (dict(fetch_policy="x"), "fetch_policy"),
    (dict(rotate_keys="yes", kv_bits=4), "rotate_keys"), (dict(readonly="no"), "readonly"),
    (dict(serve_margin=1.5), "serve_margin"), (dict(serve_margin=-0.1), "serve_margin"),
])
def test_a_setting_out_of_range_is_a_config_error_and_creates_nothing(tmp_path, monkeypatch, kwargs, says):
    monkeypatch.chdir(tmp_path)  # ssd_path="" was the working directory
    with pytest.raises(ConfigError, match=says):
        PrefixStore(**kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_remote_that_is_not_a_redis_url_is_a_remote_config_error():
    with pytest.raises(RemoteConfigError, match="redis"):
        PrefixStore(remote="http://cache-host:6379")


def test_paths_that_are_not_stores_are_store_open_errors_and_stay_as_they_were(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    others = tmp_path / "photos"
    others.mkdir()
    (others / "cat.jpg").write_bytes(b"\xff\xd8")
    foreign = tmp_path / "foreign"
    with lmdb.open(str(foreign), max_dbs=2) as env:
        env.open_db(b"theirs")
    def files():  # (LMDB's lock file is LMDB's to change)
        return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "lock.mdb"}

    before = files()
    for path, says in ((a_file, "is a file"), (others, "not a kvstore store"), (foreign, "another program")):
        with pytest.raises(StoreOpenError, match=says) as e:
            PrefixStore(ssd_path=path)
        assert "delete" not in str(e.value)  # never advise deleting what is not a kvstore store
    assert files() == before


def test_every_call_after_close_is_a_store_closed_error(tmp_path):
    s = PrefixStore(ssd_path=tmp_path / "store", block_size=BS)
    s.close()
    for call in (lambda: s.put(M, P, kv_layers(P)), lambda: s.fetch(M, P), lambda: s.contains(M, P), s.stats,
                 lambda: s.set_budget(1), lambda: s.trim_ram(0), lambda: s.trim_disk(0), s.clear,
                 lambda: s.register_model(M, {})):
        with pytest.raises(StoreClosedError):
            call()
    s.close()  # (idempotent)


def test_writes_on_a_read_only_store_are_read_only_errors(store, tmp_path):
    with PrefixStore(ssd_path=tmp_path / "store", block_size=BS, readonly=True) as r:
        for call in (lambda: r.put(M, P, kv_layers(P)), r.clear):
            with pytest.raises(ReadOnlyError):
                call()
        assert_hit_is(r.fetch(M, P), P, len(P))


def test_a_misspelt_setting_is_a_config_error_naming_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"no setting 'ssdpath'; did you mean ssd_path\b"):
        PrefixStore(ssdpath=tmp_path / "s", budget_gb=0.1)
    with pytest.raises(ConfigError, match=r"no setting 'budget_g'; did you mean budget_gb"):
        PrefixStore(StoreConfig(), budget_g=1)
    assert not (tmp_path / "s").exists()


def test_the_signature_lists_every_setting():
    import dataclasses
    import inspect

    params = inspect.signature(PrefixStore).parameters
    assert list(params)[0] == "config"
    for f in dataclasses.fields(StoreConfig):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == f.default


def test_tuning_knobs_are_nested_and_still_taken_by_their_old_names():
    import dataclasses

    from kvstore.config import Tuning

    cfg = StoreConfig(budget_gb=1, write_batch_bytes=1 << 20, evict_to=0.5)
    assert cfg.tuning == Tuning(write_batch_bytes=1 << 20, evict_to=0.5)
    assert cfg.write_batch_bytes == 1 << 20 and cfg.tuning.evict_to == 0.5  # read by the old name too
    assert cfg == StoreConfig(budget_gb=1, tuning=Tuning(write_batch_bytes=1 << 20, evict_to=0.5))
    assert dataclasses.replace(cfg, evict_to=0.75).tuning == Tuning(write_batch_bytes=1 << 20, evict_to=0.75)
    assert not {f.name for f in dataclasses.fields(StoreConfig)} & {f.name for f in dataclasses.fields(Tuning)}
    with PrefixStore(budget_gb=0.01, serve_margin=0.2) as s:
        assert s.config.tuning.serve_margin == 0.2
    with pytest.raises(ConfigError, match="evict_to"):
        StoreConfig(evict_to=3)
    with pytest.raises(ConfigError, match="did you mean write_batch_bytes"):
        PrefixStore(write_batch_byte=1)
