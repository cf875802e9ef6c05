"""The shared remote tier, against real Redis servers (single and a 3-master
cluster) that the tests start on loopback: hosts share blocks bit-exactly,
tenants stay apart, bad values are refused, and a dead, hung or restarting
server never reaches the engine."""

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore import KVLayer, PrefixStore
from kvstore.blocks.codec import Block
from kvstore.counters import Counters
from kvstore.errors import ConfigError, RemoteConfigError
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key
from kvstore.blocks.layers import Quantized
from kvstore.blocks.record import BlockRecord
from kvstore.tiers.remote.sync import Remote
from kvstore.config import StoreConfig
from kvstore.blocks.record import Entry
from kvstore.tiers.remote.tier import PREFIX, RemoteTier
from kvstore.blocks.wire import serialize

from ._helpers import assert_hit_is, kv_layers, same
from ._redis import PASSWORD, RedisServer, free_port, need_redis, start_cluster

BS = 64
MODEL = "remote-test-model"


@pytest.fixture
def server(redis_server):
    return redis_server


@pytest.fixture
def host(tmp_path):
    """Opens stores as separate hosts would: each with its own SSD directory."""
    opened = []

    def open_store(name, url, **kw):
        store = PrefixStore(**dict(dict(budget_gb=0.25, ssd_path=tmp_path / name, block_size=BS, remote=url), **kw))
        opened.append(store)
        return store
    yield open_store
    for s in opened:
        s.close()


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(1, 5000, size=n).tolist()


def put(store, tokens, model=MODEL):
    store.put(model, tokens, kv_layers(tokens))
    store.flush()


def block_name(url, tokens, i, namespace=None):
    chain = KeyChain(root_key(MODEL, namespace), as_tokens(tokens), BS)
    return RemoteTier(url, namespace).key_name(chain.key(i))


def remote_warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and "remote" in r.getMessage()]


# ------------------------------------------------------------------ sharing


def test_a_prompt_put_on_one_host_is_a_bit_exact_hit_on_another(server, host, tmp_path):
    a, b = host("a", server.url), host("b", server.url)
    tokens = prompt(300)  # 4 full blocks and a tail of 44
    put(a, tokens)
    hit = b.fetch(MODEL, tokens)
    assert_hit_is(hit, tokens, 300)
    assert hit.remote_tokens == 300
    st = b.stats()
    assert st["remote_blocks_read"] == 5 and st["tokens_remote"] == 300 and st["remote_bad"] == 0
    assert a.stats()["remote_blocks_written"] == 5
    # the host that stored them does not read its own blocks back when a later turn goes past them
    turn2 = tokens + prompt(30, seed=9)
    assert_hit_is(a.fetch(MODEL, turn2), turn2, 300)
    assert a.stats()["remote_lookups"] == 1 and a.stats()["remote_blocks_read"] == 0
    # a longer prompt on the shared prefix: found remotely as far as its full blocks go
    longer = tokens[:256] + prompt(100, seed=1)
    c = host("c", server.url)
    assert_hit_is(c.fetch(MODEL, longer), longer, 256)
    # what b read is kept locally: a restart without the remote still hits, from its SSD
    b.close()
    with PrefixStore(budget_gb=0.25, ssd_path=tmp_path / "b", block_size=BS) as local:
        again = local.fetch(MODEL, tokens)
        assert_hit_is(again, tokens, 300)
        assert again.ssd_tokens == 300


def test_a_prompt_ending_or_diverging_inside_a_stored_block_hits_as_far_as_it_shares(server, host):
    tokens = prompt(300)
    put(host("a", server.url), tokens)
    # an engine leaves the last token to compute: the stored tail block (256..300) is used in part
    b = host("b", server.url)
    assert_hit_is(b.fetch(MODEL, tokens, limit=290), tokens, 290)
    # diverging inside block 2 (tokens 128..192): its stored sibling shares 22 tokens
    other = tokens[:150] + prompt(90, seed=1)
    c = host("c", server.url)
    assert_hit_is(c.fetch(MODEL, other), other, 150)
    assert c.stats()["remote_blocks_read"] == 3 and c.stats()["remote_bad"] == 0
    # a listed child the server no longer holds: the hit stops before it and the listing forgets it
    r = server.client()
    tier, chain = RemoteTier(server.url), KeyChain(root_key(MODEL), as_tokens(tokens), BS)
    listing = tier.kids_name(chain.root, chain.key(3))
    assert r.zcard(listing) == 1
    r.delete(tier.key_name(chain.tail_key(4, 44)))
    d = host("d", server.url)
    assert_hit_is(d.fetch(MODEL, tokens, limit=290), tokens, 256)
    assert r.zcard(listing) == 0


def test_image_token_ids_travel_too(server, host):
    # image prompts carry negative ~60-bit ids (mlx-lm's Vision.cache_key): 64-bit tokens on the wire
    tokens = prompt(70) + [-(1 << 59) - 7] * 100 + prompt(60, seed=1)
    put(host("a", server.url), tokens)
    b = host("b", server.url)
    assert_hit_is(b.fetch(MODEL, tokens), tokens, len(tokens))
    c = host("c", server.url)
    assert_hit_is(c.fetch(MODEL, tokens, limit=200), tokens, 200)  # the tail block, found by its listing


def test_engines_on_two_hosts_share_a_prompt_and_generate_as_cold(server, host, tmp_path):
    # a real mlx-lm model whose cache needs state snapshots (linear attention): the snapshot flag
    # travels with the remote record, else the other host could not serve the prefix at all
    from mlx_lm import load
    from mlx_lm import stream_generate as mlx_stream_generate

    from kvstore.adapters.generate import generate
    from kvstore.adapters.tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_next", tmp_path / "model")
    model, tokenizer = load(str(path))
    tokens = [t % model.args.vocab_size for t in prompt(200, seed=5)]  # ids past the vocabulary read garbage
    reference = [r.token for r in mlx_stream_generate(model, tokenizer, tokens, max_tokens=8)]
    a, b = host("a", server.url), host("b", server.url)
    first = generate(model, tokenizer, tokens, store=a, model_path=path, max_tokens=8)
    a.flush()
    second = generate(model, tokenizer, tokens, store=b, model_path=path, max_tokens=8)
    assert first.cached_tokens == 0 and second.cached_tokens == 192  # 3 blocks with their snapshots
    assert second.remote_tokens == second.cached_tokens
    assert first.tokens == reference and second.tokens == reference


def test_two_kvstore_serve_hosts_share_a_system_prompt_through_the_server(server, tmp_path):
    from kvstore.adapters.tiny_models import make_tiny_model

    from .test_server import chat, start, stop
    from .test_server import free_port as free_http_port

    model = make_tiny_model("llama", tmp_path / "model")
    ports = [free_http_port(), free_http_port()]
    with open(tmp_path / "a.log", "wb") as la, open(tmp_path / "b.log", "wb") as lb:
        procs = [start(model, tmp_path / f"store-{h}", port, log, "--remote", server.url, "--remote-timeout", "2")
                 for h, port, log in zip("ab", ports, (la, lb))]
        try:
            first = chat(ports[0], "hello there")
            blocks = lambda: len(server.client().keys(PREFIX + b"-:{*}"))  # noqa: E731
            deadline = time.monotonic() + 30
            while blocks() < first["prompt_tokens"] // 64 and time.monotonic() < deadline:
                time.sleep(0.1)  # host a's copies are written behind its response
            other = chat(ports[1], "how are you today")
        finally:
            for p in procs:
                stop(p)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # host b never saw the system prompt: its few hundred tokens came from the server
    assert other["prompt_tokens_details"]["cached_tokens"] > 0.8 * first["prompt_tokens"]


def test_a_host_of_another_block_size_is_told_it_shares_nothing(server, host, caplog):
    """A block's key hashes its tokens, so hosts of a namespace storing one model in blocks of other sizes
    find none of each other's (never wrong KV): the later one logs a warning naming both sizes and counts
    ``remote_block_size_mismatch``; a host of the same size hits."""
    tokens = prompt(200, seed=3)
    put(host("a", server.url), tokens)
    other = host("b", server.url, block_size=2 * BS)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        put(other, tokens)
    assert other.stats()["remote_block_size_mismatch"] == 1
    assert any(f"blocks of {BS} tokens, this store in blocks of {2 * BS}" in r.getMessage() for r in caplog.records)
    assert host("c", server.url, block_size=2 * BS).fetch(MODEL, prompt(200, seed=4)).length == 0
    same_size = host("d", server.url)
    assert_hit_is(same_size.fetch(MODEL, tokens), tokens, 200)
    assert same_size.stats()["remote_block_size_mismatch"] == 0


def test_namespaces_hold_across_hosts(server, host):
    tokens = prompt(200, seed=2)
    alice = host("alice", server.url, namespace="alice")
    put(alice, tokens)
    bob = host("bob", server.url, namespace="bob")
    assert bob.fetch(MODEL, tokens).length == 0
    assert bob.stats()["remote_blocks_read"] == 0
    alice2 = host("alice2", server.url, namespace="alice")
    assert_hit_is(alice2.fetch(MODEL, tokens), tokens, 200)
    names = server.client().keys(PREFIX + b"*")
    assert names and all(n.startswith(PREFIX + b"alice:") for n in names)


def test_redis_acls_fence_tenants_with_the_rule_the_readme_gives(server, host):
    for user in ("alice", "bob"):  # docs/remote.md: ACL SETUSER tenant on >PASSWORD ~kvstore:v1:tenant:* ...
        server.cli("ACL", "SETUSER", user, "on", f">{user}-pw", f"~kvstore:v1:{user}:*", "+@read", "+@write",
                   "+@keyspace", "-@dangerous", "+info")
    as_user = lambda user: f"redis://{user}:{user}-pw@127.0.0.1:{server.port}/0"  # noqa: E731
    tokens = prompt(200, seed=3)
    put(host("a", as_user("alice"), namespace="alice"), tokens)
    assert_hit_is(host("b", as_user("alice"), namespace="alice").fetch(MODEL, tokens), tokens, 200)
    # bob's credentials cannot even ask for alice's keys: the server refuses, the engine sees a miss
    mallory = host("m", as_user("bob"), namespace="alice")
    assert mallory.fetch(MODEL, tokens).length == 0
    st = mallory.stats()
    assert st["remote_errors"] == 1 and st["remote_blocks_read"] == 0 and not st["remote_up"]


# ------------------------------------------------------------------ bad values


def test_a_hit_read_over_several_round_trips_is_placed_as_it_comes_and_stops_at_a_bad_block(server, host):
    # one block per round trip: each block is checked and placed in the hit's arrays while the next is read
    tokens = prompt(300)
    put(host("a", server.url), tokens)
    b = host("b", server.url, remote_read_bytes=1)
    put(b, tokens[:128])  # the first two blocks are local: the arrays hold both kinds
    hit = b.fetch(MODEL, tokens)
    assert_hit_is(hit, tokens, 300)
    assert hit.remote_tokens == 300 - 128 and b.stats()["remote_blocks_read"] == 3
    # stored quantized and handed over as stored: the same parts as a local hit of those blocks
    a8, c8 = host("a8", server.url, kv_bits=8), host("c8", server.url, kv_bits=8, remote_read_bytes=1)
    other = prompt(320, seed=5)
    put(a8, other, model="q8")
    remote = c8.fetch("q8", other, quantized=(8, 32))  # (the test model's head dim is 32: groups of 32)
    local = a8.fetch("q8", other, quantized=(8, 32))
    assert remote.remote_tokens == 320 and local.ram_tokens == 320
    assert len(remote.layers) == len(local.layers)
    for x, y in zip(remote.layers, local.layers):
        assert isinstance(x.keys, Quantized) and same(x.keys, y.keys) and same(x.values, y.values)
    # a flipped byte in block 3: blocks 0-2 were placed already; the hit stops before block 3, whose rows
    # never reach the engine, and the value leaves the server
    r = server.client()
    name = block_name(server.url, tokens, 3)
    payload = bytearray(r.hget(name, "p"))
    payload[-5] ^= 0x40
    r.hset(name, "p", bytes(payload))
    d = host("d", server.url, remote_read_bytes=1)
    assert_hit_is(d.fetch(MODEL, tokens), tokens, 192)
    assert d.stats()["remote_bad"] == 1 and not r.exists(name)


def test_corrupt_or_foreign_remote_values_are_refused_never_served(server, host, caplog):
    r = server.client()
    tokens = prompt(256, seed=3)
    put(host("a", server.url), tokens)
    # a flipped byte in block 2's payload: the hit stops before it, and the value leaves the server
    name = block_name(server.url, tokens, 2)
    payload = bytearray(r.hget(name, "p"))
    payload[-5] ^= 0x40
    r.hset(name, "p", bytes(payload))
    b = host("b", server.url)
    assert_hit_is(b.fetch(MODEL, tokens), tokens, 128)
    assert b.stats()["remote_bad"] == 1 and not r.exists(name)
    # block 1's record swapped for block 3's: a record of another chain is refused before any payload is read
    other = prompt(256, seed=4)
    put(host("c", server.url), other)
    r.hset(block_name(server.url, other, 1), "r", r.hget(block_name(server.url, other, 3), "r"))
    d = host("d", server.url)
    assert_hit_is(d.fetch(MODEL, other), other, 64)
    assert d.stats()["remote_bad"] == 1 and d.stats()["remote_blocks_read"] == 1
    # a value of another type under a block's name (someone else's key): a miss, no exception
    third = prompt(128, seed=6)
    r.set(block_name(server.url, third, 0), b"not ours")
    e = host("e", server.url)
    assert e.fetch(MODEL, third).length == 0
    assert e.stats()["remote_bad"] == 1
    assert all("refused" in w.getMessage() for w in remote_warnings(caplog))


# ------------------------------------------------------------------ faults


def test_a_killed_server_never_reaches_the_engine_and_the_tier_recovers(server, host, caplog):
    a, b = host("a", server.url, remote_timeout=0.3), host("b", server.url, remote_timeout=0.3)
    put(a, prompt(128, seed=7))
    assert b.fetch(MODEL, prompt(128, seed=7)).remote_tokens == 128
    server.kill()
    before = b.stats()
    for i in range(5):
        assert b.fetch(MODEL, prompt(192, seed=10 + i)).length == 0
    after = b.stats()
    # one failed call, then the breaker skips the server: no later fetch tries it
    assert after["remote_errors"] - before["remote_errors"] == 1
    assert after["remote_bypassed"] - before["remote_bypassed"] == 4
    put(a, prompt(192, seed=20))  # the local write happens; the copy is skipped
    assert a.fetch(MODEL, prompt(192, seed=20)).length == 192
    sa, sb = a.stats(), b.stats()
    assert not sa["remote_up"] and not sb["remote_up"]
    assert sa["remote_skipped"] >= 1 and sb["remote_bypassed"] >= 1 and sb["remote_errors"] >= 1
    assert len(remote_warnings(caplog)) == 2  # one per store, however many calls failed
    server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 15
    fresh = prompt(128, seed=30)
    while time.monotonic() < deadline:
        put(a, fresh)  # re-put is a no-op once stored locally: new tokens each round
        if b.fetch(MODEL, fresh).remote_tokens:
            break
        fresh = prompt(128, seed=int(fresh[0]))
        time.sleep(0.2)
    else:
        pytest.fail("the remote tier did not recover after the server restarted")
    assert a.stats()["remote_up"] and b.stats()["remote_up"]


def test_a_hung_server_costs_a_fetch_one_timeout_and_puts_nothing(server, host):
    a, b = host("a", server.url, remote_timeout=60), host("b", server.url, remote_timeout=0.3)
    server.pause()  # accepts connections, answers nothing: the slow server case
    try:
        assert b.fetch(MODEL, prompt(128, seed=8)).length == 0
        assert b.stats()["remote_errors"] == 1 and not b.stats()["remote_up"]  # one timeout, then the breaker
        p, layers = prompt(256, seed=9), kv_layers(prompt(256, seed=9))
        assert a.put(MODEL, p, layers) == 4  # returned, though the server answers nothing for a's 60 s timeout
        deadline = time.monotonic() + 30  # (liveness: until the writer has handed the copies over)
        while not a.stats()["remote_queue_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        st = a.stats()  # the copies wait on the remote thread, and the engine's thread went on
        assert st["remote_queue_bytes"] > 0 and st["remote_blocks_written"] == 0 and st["remote_errors"] == 0
    finally:
        server.resume()
    a.flush()
    assert a.fetch(MODEL, prompt(256, seed=9)).length == 256


def _entries(n: int, size: int = 256 << 10, first: int = 0) -> list[Entry]:
    """``n`` chained blocks of ``size`` payload bytes each."""
    out = []
    for i in range(first, first + n):
        rec = BlockRecord(key=i.to_bytes(16, "little"), parent=b"\0" * 16, root=b"\1" * 16, start=0, length=1,
                          tokens=np.array([i], dtype=np.int32), nbytes=size)
        out.append(Entry(rec, memoryview(os.urandom(size))))
    return out


def test_copies_beyond_the_queue_bound_are_skipped_and_counted(server):
    counters = Counters()
    remote = Remote(server.url, None, counters, StoreConfig(remote_queue_bytes=1 << 20))
    server.pause()  # slower than the engine
    try:
        for e in _entries(12):
            remote.offer([e])
        c = counters.snapshot()  # decided while the server still answers nothing: no offer waited on it
        assert c["remote_skipped"] == 8 and c["remote_blocks_written"] == 0
    finally:
        server.resume()
    assert remote.flush(10)
    c = counters.snapshot()
    assert c["remote_skipped"] == 8 and c["remote_blocks_written"] == 4  # 1 MiB held at most, in flight included
    assert len(server.client().keys(PREFIX + b"-:{*}")) == 4
    remote.close()


def test_one_write_transaction_is_queued_whole_or_skipped_whole(server):
    """A prompt's new blocks larger than the whole bound still all reach the
    remote (a gap would make every later block unservable there); an offer
    that arrives while the queue is over its bound is skipped whole."""
    counters = Counters()
    remote = Remote(server.url, None, counters, StoreConfig(remote_queue_bytes=1 << 20))
    server.pause()
    try:
        remote.offer(_entries(6))  # 1.5 MiB: past the bound, queued whole
        remote.offer(_entries(3, first=6))  # the queue is over its bound: none of these
    finally:
        server.resume()
    assert remote.flush(10)
    c = counters.snapshot()
    assert c["remote_blocks_written"] == 6 and c["remote_skipped"] == 3
    remote.close()


def test_an_unreachable_server_at_open_is_connected_later(tmp_path, caplog):
    need_redis()
    port = free_port()
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    store = PrefixStore(budget_gb=0.25, ssd_path=tmp_path / "a", block_size=BS, remote=url, remote_timeout=0.3)
    try:  # the store opened (no error) and runs on its local tiers until the server comes
        assert len(remote_warnings(caplog)) == 1 and not store.stats()["remote_up"]
        put(store, prompt(128, seed=11))
        assert_hit_is(store.fetch(MODEL, prompt(128, seed=11)), prompt(128, seed=11), 128)  # local tiers work
        server = RedisServer(tmp_path / "redis", port=port).start()
        try:
            deadline = time.monotonic() + 10
            seed = 100
            while not server.client().dbsize() and time.monotonic() < deadline:
                put(store, prompt(128, seed=seed))
                seed += 1
                time.sleep(0.2)
            assert server.client().dbsize() > 0 and store.stats()["remote_up"]
        finally:
            store.close()
            server.kill()
    finally:
        store.close()


def test_wrong_password_is_an_error_at_open_naming_the_url_without_it(server, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTORE_REMOTE_PASSWORD", raising=False)
    monkeypatch.delenv("REDISCLI_AUTH", raising=False)
    with pytest.raises(RemoteConfigError) as e:
        PrefixStore(ssd_path=tmp_path / "s", remote=f"redis://:hunter2@127.0.0.1:{server.port}/0")
    assert f"redis://:***@127.0.0.1:{server.port}/0" in str(e.value) and "hunter2" not in str(e.value)
    with pytest.raises(RemoteConfigError, match="credentials"):
        PrefixStore(remote=f"redis://127.0.0.1:{server.port}/0")  # none given, one required
    monkeypatch.setenv("KVSTORE_REMOTE_PASSWORD", PASSWORD)
    with PrefixStore(ssd_path=tmp_path / "s", remote=f"redis://127.0.0.1:{server.port}/0") as store:
        assert store.stats()["remote_up"]


@pytest.mark.parametrize("url", ["http://:hunter2@host:6379", "redis://:hunter2@host:port/0", "redis://host/db2",
                                 "unix://", "redis:///0", "redis://host:6379/0?timeout=3", "", 6379])
def test_malformed_remote_urls_are_errors_at_open(url):
    pytest.importorskip("redis")
    with pytest.raises(RemoteConfigError) as e:
        PrefixStore(remote=url)
    assert "hunter2" not in str(e.value)


def test_remote_timeout_must_be_positive():
    with pytest.raises(ConfigError):
        PrefixStore(remote="redis://127.0.0.1:1/0", remote_timeout=0)


# ------------------------------------------------------------------ cluster


def test_a_three_master_cluster_shares_blocks_spread_over_slots(tmp_path, host):
    need_redis()
    nodes = start_cluster(tmp_path / "cluster")
    try:
        a, b = host("a", nodes[0].url), host("b", nodes[2].url)
        tokens = prompt(64 * 12 + 10, seed=12)
        put(a, tokens)
        hit = b.fetch(MODEL, tokens)
        assert_hit_is(hit, tokens, len(tokens))
        assert hit.remote_tokens == len(tokens) and b.stats()["remote_cluster"]
        per_node = [int(n.cli("dbsize")) for n in nodes]
        # 13 blocks, each parent's listing of children (13 parents), the model registry
        assert sum(per_node) == 13 + 13 + 1 and sum(1 for k in per_node if k) >= 2
        res = subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", "stats", "--remote", nodes[1].url,
                              "--json"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["blocks"] == 13 and json.loads(res.stdout)["cluster"]
    finally:
        for n in nodes:
            n.kill()


# ------------------------------------------------------------------ CLI


def kvstore(*args, input=None):
    return subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", *map(str, args)], capture_output=True,
                          text=True, input=input, timeout=60)


def test_cli_stats_and_clear_act_on_one_models_remote_blocks(server, host):
    a = host("a", server.url)
    a.register_model("m1", {"name": "model-one"})
    a.put("m1", prompt(130, seed=13), kv_layers(prompt(130, seed=13)))
    a.put("m2", prompt(200, seed=14), kv_layers(prompt(200, seed=14)))
    a.flush()
    res = kvstore("stats", "--remote", server.url, "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["models"]["model-one"]["blocks"] == 3 and st["models"]["m2"]["blocks"] == 4
    assert st["maxmemory_policy"] == "allkeys-lru" and st["warnings"] == [] and "***" in st["url"]
    assert kvstore("clear", "--remote", server.url, "--model", "model-one", input="n\n").returncode == 1
    res = kvstore("clear", "--remote", server.url, "--model", "model-one", "--yes")
    assert res.returncode == 0 and "deleted 3 blocks" in res.stdout, res.stdout + res.stderr
    assert list(json.loads(kvstore("stats", "--remote", server.url, "--json").stdout)["models"]) == ["m2"]
    r = server.client()
    assert not r.keys(PREFIX + b"-:kids:" + root_key("m1").hex().encode() + b":*")  # its listings went too
    assert r.keys(PREFIX + b"-:kids:" + root_key("m2").hex().encode() + b":*")
    b = host("b", server.url)
    assert b.fetch("m1", prompt(130, seed=13)).length == 0
    assert b.fetch("m2", prompt(200, seed=14)).length == 200
    assert kvstore("stats").returncode == 2
    bad = kvstore("stats", "--remote", f"redis://:hunter2@127.0.0.1:{server.port}/0")
    assert bad.returncode == 2 and "credentials" in bad.stderr and "hunter2" not in bad.stderr


def test_the_remote_tier_writes_reads_and_removes_blocks_as_kept(server, monkeypatch):
    import kvstore.tiers.remote.tier as remote_module

    tokens = prompt(128, seed=40)
    chain = KeyChain(root_key(MODEL), as_tokens(tokens), BS)
    layers = kv_layers(tokens)
    entries = []
    for i in range(2):
        rows = [KVLayer(l.keys[:, :, i * BS:(i + 1) * BS], l.values[:, :, i * BS:(i + 1) * BS], i * BS) for l in layers]
        rec = BlockRecord(key=chain.key(i), parent=chain.parent(i), root=chain.root, start=i * BS, length=BS,
                          tokens=as_tokens(tokens[i * BS:(i + 1) * BS]), nbytes=0)
        entries.append(Entry(rec, serialize(Block(rec.tokens, rows), rec.key)))
    keys, sizes = [e.key for e in entries], [len(e.payload) for e in entries]
    sent = []  # per read, the commands of each round trip
    streamed = remote_module.streamed
    monkeypatch.setattr(remote_module, "streamed",
                        lambda pool, groups: (sent.append([len(g) for g in groups]), streamed(pool, groups))[1])
    tier = RemoteTier(server.url)
    tier.connect()
    try:
        tier.put_many([(e.record, e.payload) for e in entries])
        got = list(tier.entries(keys))
        assert sent[-1] == [2]  # sizes unknown: one round trip
        assert [ok for _, _, ok in got] == [None, None]  # no secret: nothing checked
        assert [bytes(p) for _, p, _ in got] == [bytes(e.payload) for e in entries]  # the same bytes back
        assert [BlockRecord.unpack(e.key, r).tokens.tolist() for e, (r, _, _) in zip(entries, got)] == \
            [e.record.tokens.tolist() for e in entries]
        # with sizes, round trips of about read_bytes on one connection, in order, each block handed over as
        # it comes in
        tier.read_bytes = sizes[0]
        got = list(tier.entries(keys * 2, sizes * 2))
        assert sent[-1] == [1, 1, 1, 1]
        assert [bytes(p) for _, p, _ in got] == [bytes(e.payload) for e in entries] * 2
        assert tier.payloads(keys * 2, sizes * 2) == [p for _, p, _ in got] and sent[-1] == [1, 1, 1, 1]
        # a reader that stops early stops the read; its connection's unread replies never reach the next read
        it = tier.entries(keys * 3, sizes * 3)
        assert bytes(next(it)[1]) == bytes(entries[0].payload)
        it.close()
        assert [bytes(p) for _, p, _ in tier.entries(keys[::-1], sizes[::-1])] == \
            [bytes(e.payload) for e in entries[::-1]]
        assert tier.remove([entries[1].key, b"\0" * 16]) == [entries[1].key]
        assert [p is None for _, p, _ in tier.entries(keys)] == [False, True]
    finally:
        tier.close()
