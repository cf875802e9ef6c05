"""Authenticated remote blocks (``remote_secret``), against a real Redis server:
with a secret, blocks written without it or under another one are never
served (counted, left on the server); with the same secret they hit bit-exact;
the secret never shows in a repr, stats or the log."""

import logging
import time
from dataclasses import replace

import pytest

from kvstore import PrefixStore
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
from kvstore.blocks.record import BlockRecord
from kvstore.tiers.remote.auth import SECRET_ENV, Signer

from ._helpers import assert_hit_is
from .test_remote import MODEL, block_name, host, prompt, put, server  # noqa: F401 (fixtures)

SECRET = "correct horse battery staple"


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)  # stores without remote_secret here have none


def test_with_the_same_secret_remote_blocks_hit_bit_exact_and_carry_their_mac(server, host):
    a = host("a", server.url, remote_secret=SECRET)
    tokens = prompt(300)  # 4 full blocks and a 44-token tail (read as the partial child)
    put(a, tokens)
    r = server.client()
    tags = [r.hget(block_name(server.url, tokens, i), "a") for i in range(4)]
    assert all(t is not None and len(t) == 32 for t in tags) and len(set(tags)) == 4
    b = host("b", server.url, remote_secret=SECRET)
    hit = b.fetch(MODEL, tokens)
    assert_hit_is(hit, tokens, 300)
    st = b.stats()
    assert hit.remote_tokens == 300 and st["remote_blocks_read"] == 5 and st["remote_unauthenticated"] == 0
    assert st["remote_authenticated"] is True
    # a reader without a secret trusts the tier as before: signed blocks serve it too
    c = host("c", server.url)
    assert_hit_is(c.fetch(MODEL, tokens), tokens, 300)
    assert c.stats()["remote_authenticated"] is False


@pytest.mark.parametrize("writer_secret", [None, "another secret"], ids=["unsigned", "other-secret"])
def test_blocks_written_without_the_secret_or_with_another_are_never_served(server, host, writer_secret):
    tokens = prompt(300, seed=1)
    put(host("w", server.url, remote_secret=writer_secret), tokens)
    b = host("b", server.url, remote_secret=SECRET)
    assert_hit_is(b.fetch(MODEL, tokens), tokens, 0)
    st = b.stats()
    assert st["remote_unauthenticated"] == 1 and st["remote_blocks_read"] == 0 and st["remote_bad"] == 0
    # skipped, not deleted: the server may be shared with stores of no or another secret
    assert server.client().exists(block_name(server.url, tokens, 0))
    # b computes the prompt itself: its signed copies replace the others' and serve the next host with the secret
    put(b, tokens)
    d = host("d", server.url, remote_secret=SECRET)
    assert_hit_is(d.fetch(MODEL, tokens), tokens, 300)
    assert d.stats()["remote_unauthenticated"] == 0


def test_a_genuine_tag_left_under_other_bytes_does_not_fit_them(server, host):
    # a writer without the secret overwrites signed blocks with blocks of its own (other bits, same keys):
    # the genuine tags stay beside bytes they were not made for, and a host with the secret serves nothing
    tokens = prompt(256, seed=2)
    put(host("a", server.url, remote_secret=SECRET), tokens)
    r = server.client()
    name = block_name(server.url, tokens, 0)
    tag, payload = r.hget(name, "a"), r.hget(name, "p")
    put(host("m", server.url, kv_bits=8), tokens)
    assert r.hget(name, "a") == tag and r.hget(name, "p") != payload
    b = host("b", server.url, remote_secret=SECRET)
    assert b.fetch(MODEL, tokens).length == 0
    assert b.stats()["remote_unauthenticated"] == 1 and b.stats()["remote_blocks_read"] == 0
    # a tag moved onto another block's bytes (record and payload of block 1 under block 0's tag) fits neither
    put(host("a2", server.url, remote_secret=SECRET), tokens)
    other = block_name(server.url, tokens, 1)
    r.hset(other, "a", r.hget(name, "a"))
    c = host("c", server.url, remote_secret=SECRET)
    assert_hit_is(c.fetch(MODEL, tokens), tokens, 64)
    assert c.stats()["remote_unauthenticated"] == 1


def test_the_record_a_block_is_indexed_by_must_be_the_one_its_mac_covers(server, host, monkeypatch):
    # the probe reads a forged record (it claims other rows); the genuine one is put back before the payloads
    # are read, so the MAC read with them checks out, but not for the record the fetch would index
    tokens = prompt(128, seed=4)
    put(host("a", server.url, remote_secret=SECRET), tokens)
    r = server.client()
    name = block_name(server.url, tokens, 0)
    genuine = r.hget(name, "r")
    rec = BlockRecord.unpack(KeyChain(root_key(MODEL), as_tokens(tokens), 64).key(0), genuine)
    r.hset(name, "r", replace(rec, rows_from=rec.start + 10).pack())
    b = host("b", server.url, remote_secret=SECRET)
    tier = b._remote._tier
    read = tier.entries
    monkeypatch.setattr(tier, "entries", lambda keys, sizes=None: (r.hset(name, "r", genuine), read(keys, sizes))[1])
    assert b.fetch(MODEL, tokens).length == 0
    assert b.stats()["remote_unauthenticated"] == 1 and b.stats()["remote_blocks_read"] == 0


def test_the_mac_binds_key_record_and_payload_apart():
    s = Signer(b"k")
    tag = s.tag(b"key", b"record", b"payload")
    assert s.valid(b"key", b"record", memoryview(b"payload"), tag)
    assert not s.valid(b"key", b"recordp", b"ayload", tag)  # bytes moved from one field to the next
    assert not s.valid(b"kez", b"record", b"payload", tag)
    assert not Signer(b"k2").valid(b"key", b"record", b"payload", tag)
    assert not s.valid(b"key", b"record", b"payload", None) and not s.valid(b"key", None, b"payload", tag)


def test_the_secret_comes_from_the_environment_and_is_never_shown(server, host, monkeypatch, caplog):
    tokens = prompt(200, seed=3)
    put(host("a", server.url, remote_secret=SECRET), tokens)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    caplog.set_level(logging.DEBUG, logger="kvstore")
    b = host("b", server.url)  # the secret from $KVSTORE_REMOTE_SECRET
    assert_hit_is(b.fetch(MODEL, tokens), tokens, 200)
    assert b.stats()["remote_authenticated"] is True
    monkeypatch.setenv(SECRET_ENV, "not it")
    c = host("c", server.url)
    assert c.fetch(MODEL, tokens).length == 0 and c.stats()["remote_unauthenticated"] == 1
    assert any("remote_secret" in m.getMessage() for m in caplog.records)  # the skip is logged ...
    for shown in (repr(StoreConfig(remote_secret=SECRET)), str(b.stats()), str(c.stats()), caplog.text):
        assert SECRET not in shown and "not it" not in shown  # ... the secret never is
    with pytest.raises(ConfigError, match="remote_secret"):
        PrefixStore(remote_secret="")


def test_servers_take_remote_secret():
    from kvstore.adapters import vllm_mlx_serve
    from kvstore.adapters.server import parse_args

    assert parse_args(["--model", "m", "--remote-secret", SECRET])[0]["remote_secret"] == SECRET
    assert parse_args(["--model", "m"])[0]["remote_secret"] is None  # then $KVSTORE_REMOTE_SECRET, if set
    assert vllm_mlx_serve.parse_serve_args(["./m", "--remote-secret", SECRET])[0]["remote_secret"] == SECRET


def test_kvstore_serve_hosts_share_only_blocks_of_their_secret(server, tmp_path):
    # real servers: a and c take the secret from the environment, b another one from --remote-secret
    import os

    from kvstore.adapters.tiny_models import make_tiny_model

    from .test_remote import PREFIX
    from .test_server import chat, start, stop
    from .test_server import free_port as free_http_port

    model = make_tiny_model("llama", tmp_path / "model")
    env = dict(os.environ, **{SECRET_ENV: SECRET})
    hosts = {"a": ([], env), "c": ([], env), "b": (["--remote-secret", "another secret"], None)}
    ports = {h: free_http_port() for h in hosts}
    logs = {h: open(tmp_path / f"{h}.log", "wb") for h in hosts}
    procs = [start(model, tmp_path / f"store-{h}", ports[h], logs[h], "--remote", server.url, *extra, env=e)
             for h, (extra, e) in hosts.items()]
    try:
        first = chat(ports["a"], "hello there")
        deadline = time.monotonic() + 30
        while len(server.client().keys(PREFIX + b"-:{*}")) < first["prompt_tokens"] // 64 \
                and time.monotonic() < deadline:
            time.sleep(0.1)  # a's copies are written behind its response
        same = chat(ports["c"], "how are you today")
        other = chat(ports["b"], "how are you today")
    finally:
        for p in procs:
            stop(p)
        for f in logs.values():
            f.close()
    assert same["prompt_tokens_details"]["cached_tokens"] > 0.8 * first["prompt_tokens"]
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    assert not any(SECRET in (tmp_path / f"{h}.log").read_text(errors="replace") for h in hosts)
