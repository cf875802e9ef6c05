"""`kvstore explain`, driven as a real subprocess against real stores: each reason a separate process can see
(new, tail, other_model, declined, unavailable), a block flipped on disk (shown on disk: explain reads no
payload), the JSON's blocks adding up to the prompt, one-line errors, and the command beside a process that
keeps writing the store, changing nothing."""

import hashlib
import json
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest

from kvstore import KVLayer, PrefixStore
from kvstore.blocks.hashing import KeyChain, as_tokens, root_key

from ._helpers import flip_a_byte

MODEL = "explain-model"
BS = 16


def kvstore(*args, input=None):
    return subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", *map(str, args)], capture_output=True,
                          text=True, input=input, timeout=120)


def layers(n, seed=0):
    mx.random.seed(seed)
    return [KVLayer(mx.random.normal((1, 2, n, 32)).astype(mx.float16),
                    mx.random.normal((1, 2, n, 32)).astype(mx.float16)) for _ in range(2)]


def explained(*args) -> dict:
    """`kvstore explain ... --json`, its blocks checked to add up to the prompt and to its totals."""
    res = kvstore("explain", *args, "--json")
    assert res.returncode == 0, res.stderr
    e = json.loads(res.stdout)
    per: dict[str, int] = {}
    for b in e["blocks"]:
        assert b["served"] + sum(b["not_served"].values()) == b["end"] - b["start"]
        for r, k in b["not_served"].items():
            per[r] = per.get(r, 0) + k
    assert per == e["not_served"] and sum(b["served"] for b in e["blocks"]) == e["served"]
    assert e["served"] + sum(e["not_served"].values()) == e["tokens"] == e["blocks"][-1]["end"]
    return e


@pytest.fixture
def model_dir(tmp_path):
    """A model folder with a word-level tokenizer: "w7" is token 7."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)} | {"[UNK]": 300}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def store_path(tmp_path, model_dir):
    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=BS) as store:
        store.register_model(MODEL, {"name": "tiny", "path": str(model_dir)})
        store.register_model("other-key", {"name": "other"})
        store.put(MODEL, list(range(100)), layers(100))
        store.put("other-key", list(range(200, 264)), layers(64, 1))
    return path


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_a_prompt_block_by_block_as_a_table_and_as_json(store_path):
    prompt = words(list(range(70)) + [250] * 30)  # departs from the stored prompt inside block 4
    res = kvstore("explain", store_path, "--model", "tiny", "--prompt", prompt)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert "tiny" in text and "100 prompt tokens, blocks of 16" in text and "tiers seen: disk" in text
    assert "not seen from here" in text and "cost model (fetch_policy auto): serve 70 of 70" in text
    assert "0-3 " in text and "nowhere" in text and "new 16" in text and "tail 10" in text
    assert "served 70 (70%), not served 30" in text
    e = explained(store_path, "--model", "tiny", "--prompt", prompt)
    assert e["served"] == 70 and e["not_served"] == {"tail": 14, "new": 16} and e["tiers"] == ["ram", "disk"]
    assert [b["where"] for b in e["blocks"]] == ["disk"] * 5 + ["nowhere"] * 2
    assert e["blocks"][4]["served"] == 6 and e["blocks"][4]["not_served"] == {"tail": 10}


def test_token_files_and_other_model(store_path, tmp_path):
    ids = list(range(200, 264)) + [1, 2, 3]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    (tmp_path / "ids.txt").write_text("\n".join(map(str, ids)))
    e = explained(store_path, "--model", MODEL, "--tokens", tmp_path / "ids.json")  # by its model key
    assert e == explained(store_path, "--model", "tiny", "--tokens", tmp_path / "ids.txt")
    assert e["model"] == "tiny" and e["not_served"] == {"other_model": 64, "tail": 3}
    assert [b["held_by"] for b in e["blocks"]] == ["other"] * 4 + [None]
    res = kvstore("explain", store_path, "--model", "tiny", "--tokens", "-", input=" ".join(map(str, ids)))
    assert res.returncode == 0 and "held by other" in res.stdout and "other_model 64" in res.stdout


def test_declined_by_the_saved_rates_and_served_under_policy_always(tmp_path):
    path, p = tmp_path / "store", list(range(64))
    with PrefixStore(ssd_path=path, block_size=BS) as store:
        store.register_model(MODEL, {"name": "tiny"})
        store.put(MODEL, p, layers(64))
        store.flush()
        assert store.fetch(MODEL, p).length == 64  # a load rate measured
        for n in (100, 1000, 4000, 8000):  # and an engine that prefills 1e9 tokens/s: kept in the store
            store.observe_prefill(MODEL, 0, n, n * 1e-9)
    (tmp_path / "ids").write_text(" ".join(map(str, p)))
    e = explained(path, "--model", "tiny", "--tokens", tmp_path / "ids")
    v = e["verdict"]
    assert e["not_served"] == {"declined": 64} and v["length"] == 0 and v["servable"] == 64
    assert "recomputing" in v["reason"] and v["recompute_s"] < v["load_s"] + v["prefill_s"] + 1e-3
    text = kvstore("explain", path, "--model", "tiny", "--tokens", tmp_path / "ids").stdout
    assert "serve 0 of 64 servable tokens: recompute the whole prompt" in text and "recomputing" in text
    e = explained(path, "--model", "tiny", "--tokens", tmp_path / "ids", "--policy", "always")
    assert e["served"] == 64 and e["verdict"]["reason"] == "policy always"


def test_a_flipped_byte_shows_on_disk(store_path, tmp_path):
    """explain reads no payload: the damaged block shows where it is, served; the fetch that reads it will
    find it corrupt (`kvstore verify` finds it now)."""
    key = KeyChain(root_key(MODEL), as_tokens(list(range(100))), BS).key(2)
    flip_a_byte(store_path, key)
    (tmp_path / "ids").write_text(json.dumps(list(range(96))))
    e = explained(store_path, "--model", "tiny", "--tokens", tmp_path / "ids")
    assert e["served"] == 96 and {b["where"] for b in e["blocks"]} == {"disk"}
    assert kvstore("verify", store_path).returncode == 1


def test_the_remote_stopped_and_running(store_path, tmp_path, redis_server):
    p = list(range(1000, 1048))
    with PrefixStore(ssd_path=tmp_path / "host", block_size=BS, remote=redis_server.url) as host:
        host.register_model(MODEL, {"name": "tiny"})
        host.put(MODEL, p, layers(48))
        host.flush()
    (tmp_path / "ids").write_text(json.dumps(p))
    args = (store_path, "--model", "tiny", "--tokens", tmp_path / "ids", "--remote", redis_server.url)
    e = explained(*args)
    assert e["served"] == 48 and [b["where"] for b in e["blocks"]] == ["remote"] * 3
    assert e["tiers"] == ["ram", "disk", "remote"]
    redis_server.kill()
    e = explained(*args)
    assert e["served"] == 0 and e["not_served"] == {"unavailable": 48}
    assert "unavailable 48" in kvstore("explain", *args).stdout


def test_errors_are_one_line(store_path, tmp_path):
    def refused(*args, words=()):
        res = kvstore("explain", store_path, *args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert all(w in lines[0] for w in words), lines[0]

    refused("--model", "nope", "--prompt", "w1", words=("no model 'nope'", "other, tiny"))
    refused("--model", "tiny", words=("--prompt TEXT or",))
    refused("--model", "tiny", "--prompt", "w1", "--tokens", "-", words=("one of them",))
    refused("--model", "other", "--prompt", "w1", words=("no tokenizer found for 'other'", "--tokens FILE"))
    (tmp_path / "bad").write_text("1 2 three")
    refused("--model", "tiny", "--tokens", tmp_path / "bad", words=("not a JSON list",))
    refused("--model", "tiny", "--tokens", tmp_path / "missing", words=("No such file",))
    refused("--model", "tiny", "--prompt", "w1", "--policy", "sometimes", words=("fetch_policy",))
    res = kvstore("explain", tmp_path / "nothing", "--model", "tiny", "--prompt", "w1")
    assert res.returncode == 2 and "no kvstore store here" in res.stderr and not (tmp_path / "nothing").exists()


WRITER = textwrap.dedent("""
    import sys, mlx.core as mx
    from pathlib import Path
    from kvstore import KVLayer, PrefixStore
    path, stop = sys.argv[1], Path(sys.argv[2])
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16) as store:
        i = 0
        while not stop.exists():
            p = list(range(64)) + [1000 + i] * 32
            kv = [KVLayer(mx.zeros((1, 2, 96, 32), mx.float16), mx.zeros((1, 2, 96, 32), mx.float16))] * 2
            store.put("explain-model", p, kv)
            store.flush()
            if i == 0:
                print("writing", flush=True)
            i += 1
""")


def test_beside_a_process_that_keeps_writing(store_path, tmp_path):
    (tmp_path / "ids").write_text(json.dumps(list(range(64)) + [1000] * 32))
    args = (store_path, "--model", "tiny", "--tokens", tmp_path / "ids")
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(store_path), str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        for _ in range(3):
            e = explained(*args)
            assert e["served"] == 96 and {b["where"] for b in e["blocks"]} == {"disk"}
            time.sleep(0.1)
    finally:
        stop.touch()
        assert writer.wait(timeout=60) == 0


def test_explain_changes_nothing_in_the_store(store_path, tmp_path):
    def state():
        stats = json.loads(kvstore("stats", store_path, "--json").stdout)
        return stats, hashlib.sha256((store_path / "data.mdb").read_bytes()).hexdigest()

    (tmp_path / "ids").write_text(json.dumps(list(range(120))))
    was = state()
    for policy in ("auto", "always"):
        explained(store_path, "--model", "tiny", "--tokens", tmp_path / "ids", "--policy", policy)
    assert state() == was
