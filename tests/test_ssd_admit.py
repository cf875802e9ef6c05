"""SSD admission (``ssd_admit``): under "reuse" a block reaches the LMDB file
only once it is asked for again (a second put shares it, or a fetch serves
it from RAM), with its whole prefix; one-off prompts cost no SSD writes.
"always" (the default) writes every block through, as before. The LMDB file
is opened and read directly, and restarts are real reopens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore import PrefixStore
from kvstore.errors import ConfigError

from ._helpers import BLOCK_BYTES, BS, M, assert_hit_is, put, toks


_READ = """
import json, sys
import lmdb
from kvstore.blocks.record import BlockRecord
env = lmdb.open(sys.argv[1], max_dbs=8, subdir=True, readonly=True, lock=False)
with env.begin() as txn:
    nodes, blocks = env.open_db(b"nodes", txn=txn, create=False), env.open_db(b"blocks", txn=txn, create=False)
    recs = [BlockRecord.unpack(bytes(k), bytes(v)) for k, v in txn.cursor(db=nodes)]
    payloads = {bytes(k).hex(): len(v) for k, v in txn.cursor(db=blocks)}
print(json.dumps({"records": [dict(key=r.key.hex(), parent=r.parent.hex(), root=r.root.hex(), start=r.start,
                                   length=r.length) for r in recs], "payloads": payloads}))
"""


def _on_disk(path) -> dict[str, dict]:
    """The blocks in the LMDB file, by key, read by another process (this one has it open) with lmdb alone."""
    got = json.loads(subprocess.run([sys.executable, "-c", _READ, str(path)], check=True, capture_output=True,
                                    text=True).stdout)
    recs = {r["key"]: dict(r, nbytes=got["payloads"].get(r["key"])) for r in got["records"]}
    assert set(got["payloads"]) == set(recs)  # a payload per record, no more
    return recs


def _orphans(recs: dict[str, dict]) -> list[str]:
    return [k for k, r in recs.items() if r["parent"] != r["root"] and r["parent"] not in recs]


@pytest.fixture
def reuse(ssd):
    return lambda **kw: ssd(ssd_admit="reuse", **kw)


def test_a_prompt_seen_once_leaves_nothing_on_disk(reuse, tmp_path):
    s = reuse()
    put(s, toks(40))
    put(s, toks(24, start=5000))
    s.flush()
    st = s.stats()
    assert st["blocks_stored"] == 8 and st["ram_blocks"] == 8
    assert st["blocks_written"] == 0 and st["bytes_written"] == 0 and st["ssd_blocks"] == 0
    assert _on_disk(tmp_path / "store") == {}
    s.close()
    s = reuse()  # nothing of it survives a restart
    assert s.fetch(M, toks(40)).length == 0


def test_a_prompt_shared_by_a_second_put_is_written_with_its_prefix_and_survives_a_restart(reuse, tmp_path):
    s = reuse()
    a, b = toks(40), toks(32) + toks(16, start=7000)  # b shares a's first 4 blocks (32 tokens)
    put(s, a)
    s.flush()
    assert _on_disk(tmp_path / "store") == {}
    put(s, b)
    s.flush()
    recs = _on_disk(tmp_path / "store")
    assert sorted((r["start"], r["length"]) for r in recs.values()) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert _orphans(recs) == []
    st = s.stats()
    assert st["blocks_written"] == 4 and st["bytes_written"] == 4 * BLOCK_BYTES and st["ssd_blocks"] == 4
    s.close()
    s = reuse()  # the shared prefix survives, bit-exact; what each prompt had alone does not
    assert_hit_is(s.fetch(M, a), a, 32)
    assert_hit_is(s.fetch(M, b), b, 32)
    assert s.fetch(M, a).ssd_tokens + s.fetch(M, a).ram_tokens == 32


def test_a_put_that_only_extends_a_stored_sequence_writes_nothing(reuse, tmp_path):
    """An engine stores a request's prompt, then its prompt and answer: one prompt, not two."""
    s = reuse()
    put(s, toks(44))  # 5 whole blocks and a partial one
    put(s, toks(60))  # the same tokens and more
    put(s, toks(60))  # and the same again
    s.flush()
    assert s.stats()["blocks_written"] == 0 and _on_disk(tmp_path / "store") == {}


def test_a_fetch_hit_in_ram_writes_the_chain_served(reuse, tmp_path):
    s = reuse()
    a = toks(44)  # 5 whole blocks and a partial one
    put(s, a)
    s.flush()
    assert _on_disk(tmp_path / "store") == {}
    hit = s.fetch(M, a)
    assert hit.length == 44 and hit.ram_tokens == 44
    s.flush()
    recs = _on_disk(tmp_path / "store")
    assert len(recs) == 6 and _orphans(recs) == []
    assert s.stats()["bytes_written"] == sum(r["nbytes"] for r in recs.values())
    s.close()
    s = reuse()
    hit = s.fetch(M, a)
    assert_hit_is(hit, a, 44)
    assert hit.ssd_tokens == 44


def test_a_block_written_late_never_reaches_disk_without_its_parent(reuse, tmp_path):
    """A fetch of a short prefix admits only that prefix; a later, longer one the rest below it."""
    s = reuse()
    a = toks(48)
    put(s, a)
    s.fetch(M, a[:16])
    s.flush()
    assert sorted(r["start"] for r in _on_disk(tmp_path / "store").values()) == [0, 8]
    s.fetch(M, a)
    s.flush()
    recs = _on_disk(tmp_path / "store")
    assert len(recs) == 6 and _orphans(recs) == []


def test_blocks_dropped_from_ram_before_reuse_are_counted_and_gone(reuse, tmp_path):
    s = reuse(budget_gb=3 * BLOCK_BYTES / (1 << 30))  # RAM for 3 blocks
    put(s, toks(24))
    put(s, toks(24, start=5000))  # evicts the first prompt's blocks: never admitted, so dropped
    s.flush()
    st = s.stats()
    assert st["evicted_unadmitted"] == 3 and st["blocks_written"] == 0
    assert s.fetch(M, toks(24)).length == 0
    assert _on_disk(tmp_path / "store") == {}


def test_always_writes_every_block_through(ssd, tmp_path):
    s = ssd()  # ssd_admit="always", the default
    assert s.config.ssd_admit == "always"
    put(s, toks(40))
    s.flush()
    recs = _on_disk(tmp_path / "store")
    assert len(recs) == 5 and _orphans(recs) == []
    st = s.stats()
    assert st["blocks_written"] == 5 and st["bytes_written"] == 5 * BLOCK_BYTES and st["evicted_unadmitted"] == 0
    s.close()
    assert_hit_is(ssd().fetch(M, toks(40)), toks(40), 40)


def test_lifetime_counters_of_writes_are_saved_in_the_store(reuse, tmp_path):
    from kvstore.tiers.disk.lmdb import LmdbTier

    s = reuse()
    put(s, toks(16))
    s.fetch(M, toks(16))
    s.close()
    tier = LmdbTier.open(tmp_path / "store", None, readonly=True)
    try:
        c = tier.get_counters()
    finally:
        tier.close()
    assert c["blocks_written"] == 2 and c["bytes_written"] == 2 * BLOCK_BYTES


def test_ssd_admit_is_checked():
    with pytest.raises(ConfigError, match="ssd_admit must be one of"):
        PrefixStore(ssd_admit="sometimes")


def test_kvstore_stats_shows_what_was_written_to_ssd(reuse, tmp_path):
    s = reuse()
    put(s, toks(24))
    put(s, toks(16) + toks(8, start=9000))  # shares two blocks: those are written
    s.close()
    run = subprocess.run([sys.executable, "-m", "kvstore", "stats", str(tmp_path / "store")], capture_output=True,
                         text=True, check=True)
    assert "SSD writes: 2 blocks" in run.stdout
    run = subprocess.run([sys.executable, "-m", "kvstore", "stats", str(tmp_path / "store"), "--json"],
                         capture_output=True, text=True, check=True)
    lifetime = json.loads(run.stdout)["lifetime"]
    assert lifetime["blocks_written"] == 2 and lifetime["bytes_written"] == 2 * BLOCK_BYTES
    assert lifetime.get("evicted_unadmitted", 0) == 0  # (counters are saved once non-zero)


def test_the_commands_that_open_a_store_take_ssd_admit():
    from kvstore.adapters.server import parse_args
    from kvstore.adapters.vllm_mlx_serve import parse_serve_args

    assert parse_args(["--model", "m", "--ssd-admit", "reuse"])[0]["ssd_admit"] == "reuse"
    assert parse_args(["--model", "m"])[0]["ssd_admit"] == "always"
    assert parse_serve_args(["./m", "--ssd-admit", "reuse"])[0]["ssd_admit"] == "reuse"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "m", "--ssd-admit", "sometimes"])
    assert exit_.value.code == 2
    run = subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", "generate", "--model", "smollm2", "--prompt",
                          "x", "--ssd-admit", "sometimes"], capture_output=True, text=True)
    assert run.returncode == 2 and "ssd_admit must be one of" in run.stderr
