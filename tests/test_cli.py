"""The `kvstore` command, driven as a real subprocess against stores a test wrote."""

import json
import subprocess
import sys

import lmdb
import mlx.core as mx
import pytest

from kvstore import KVLayer, PrefixStore

MODEL = "cli-test-model"


def kvstore(*args, input=None):
    return subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=120)


def layers(n, seed):
    mx.random.seed(seed)
    return [KVLayer(mx.random.normal((1, 2, n, 32)).astype(mx.float16),
                    mx.random.normal((1, 2, n, 32)).astype(mx.float16)) for _ in range(2)]


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16, kv_bits=8) as store:
        store.register_model(MODEL, {"name": "tiny-llama"})
        for i in range(3):
            tokens = list(range(40)) + [100 + i] * (10 + 10 * i)
            store.put(MODEL, tokens, layers(len(tokens), i))
        store.flush()
        assert store.fetch(MODEL, list(range(40)) + [100] * 10).length == 50
    return path


def test_inspect_lists_entries_as_table_and_json(store_path):
    table = kvstore("inspect", store_path)
    assert table.returncode == 0, table.stderr
    assert "tiny-llama" in table.stdout and "K8/V8 g32" in table.stdout
    rows = [json.loads(line) for line in kvstore("inspect", store_path, "--json").stdout.splitlines()]
    assert sorted(r["tokens"] for r in rows) == [50, 60, 70]
    assert all(r["model"] == "tiny-llama" and r["kv"] == "K8/V8 g32" and r["dtype"] == "float16" for r in rows)
    assert sum(r["hits"] for r in rows) == 1
    big = [json.loads(l) for l in kvstore("inspect", store_path, "--json", "--min-tokens", "65").stdout.splitlines()]
    assert [r["tokens"] for r in big] == [70]


def test_stats_totals(store_path):
    res = kvstore("stats", store_path, "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert stats["entries"] == 3
    # two shared blocks, then per prompt: 50 -> 2 more, 60 -> 2, 70 -> 3 (the third block holds the differing token)
    assert stats["blocks"] == 2 + 2 + 2 + 3
    assert stats["lifetime"]["hits"] == 1 and stats["tokens_saved"] == 50


def test_verify_good_store_then_corrupted_block(store_path):
    ok = kvstore("verify", store_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    env = lmdb.open(str(store_path), max_dbs=8)
    blocks = env.open_db(b"blocks", create=False)
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=blocks)))
        bad = bytearray(value)
        bad[-3] ^= 0xFF
        txn.put(key, bytes(bad), db=blocks)
    env.close()
    res = kvstore("verify", store_path)
    assert res.returncode == 1 and "checksum" in res.stdout
    fixed = kvstore("verify", store_path, "--repair")
    assert fixed.returncode == 1 and "removed" in fixed.stdout
    assert kvstore("verify", store_path).returncode == 0


def test_image_prompt_entries_are_listed_and_verified(tmp_path):
    """A store holding a prompt with mlx-lm's 64-bit image ids: inspect shows
    its first tokens as they are, its text with the image as ``<image>``, and
    verify finds every block intact."""
    from kvstore.adapters.tiny_models import ensure_tiny_model

    path, image = tmp_path / "store", -1 - int("9f86d081884c7d6", 16)
    tokens = [40, 41, 42] + [image] * 8 + list(range(50, 69))
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16) as store:
        store.register_model(MODEL, {"name": "tiny-vlm", "path": str(ensure_tiny_model("llama"))})
        store.put(MODEL, tokens, layers(len(tokens), 0))
    (row,) = [json.loads(line) for line in kvstore("inspect", path, "--json").stdout.splitlines()]
    assert row["tokens"] == 30 and row["first_tokens"] == tokens[:16]
    assert row["text"].count("<image>") == 1 and len(row["text"]) > len("<image>")
    check = kvstore("verify", path)
    assert check.returncode == 0, check.stdout + check.stderr


def test_clear_asks_first_unless_yes(store_path):
    no = kvstore("clear", store_path, "--all", input="n\n")
    assert no.returncode == 1 and "nothing deleted" in no.stdout
    assert json.loads(kvstore("stats", store_path, "--json").stdout)["blocks"] == 9
    yes = kvstore("clear", store_path, "--all", "--yes")
    assert yes.returncode == 0 and "deleted 9 blocks" in yes.stdout
    assert json.loads(kvstore("stats", store_path, "--json").stdout)["blocks"] == 0


def test_errors_name_the_path_and_the_fix(tmp_path):
    missing = kvstore("inspect", tmp_path / "nothing")
    assert missing.returncode == 2 and "nothing" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "file").write_text("mine")
    foreign = kvstore("stats", tmp_path / "file")
    assert foreign.returncode == 2 and "is a file" in foreign.stderr
    assert (tmp_path / "file").read_text() == "mine"


def test_every_command_has_help_with_an_example():
    for cmd in ("inspect", "stats", "verify", "clear", "demo", "bench"):
        res = kvstore(cmd, "--help")
        assert res.returncode == 0 and "Example" in res.stdout, cmd


def test_demo_runs_end_to_end_and_hits_from_ssd_after_restart(tmp_path):
    res = kvstore("demo", "--ssd-path", tmp_path / "demo", "--users", "2", "--max-tokens", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    after = res.stdout.split("after restart")[1]
    rows = [l for l in after.splitlines() if l.startswith("│")]
    # user turn prompt ram ssd computed ttft, then the answer (noise from the random-weight model)
    cells = [[int(c) for c in r.split("│")[1:8]] for r in rows]
    assert len(cells) == 4
    # a restarted engine: the first request comes from SSD, every prompt is served
    # from the store but its last token (blocks read from SSD are promoted to RAM)
    assert cells[0][4] == cells[0][2] - 1
    assert all(c[5] == 1 and c[3] + c[4] == c[2] - 1 for c in cells)


def test_stats_shows_the_measured_rates_and_prefill_model(tmp_path):
    """What the cost model learned is kept in the store and shown by stats."""
    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16) as store:
        store.register_model(MODEL, {"name": "tiny-llama"})
        tokens = list(range(48))
        store.put(MODEL, tokens, layers(48, 0))
        store.flush()
        assert store.fetch(MODEL, tokens).length == 48
        for n in (100, 1000, 4000):
            store.observe_prefill(MODEL, 0, n, n / 50_000)
    res = kvstore("stats", path, "--json")
    assert res.returncode == 0, res.stderr
    (machine, measured), = json.loads(res.stdout)["rates"].items()
    assert measured["rates"]["ram"]["observed"] == 1 and measured["rates"]["ram"]["gb_per_s"] > 0
    assert measured["prefill"]["tiny-llama"]["tokens_per_s_at_8k"] == pytest.approx(50_000, rel=1e-6)
    text = kvstore("stats", path).stdout
    assert "prefill of tiny-llama: 50,000 tokens/s" in text and "measured on" in text
