"""One model, one key in every engine: a prompt stored through `kvstore run -- python -m mlx_lm generate` (the
engine loads the model itself) is served by `kvstore generate` on the same folder and the other way round, with
the engine's own answers, and `kvstore inspect` lists the model once, by its folder's name. Real processes, a
real model folder, a real store."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.adapters.tiny_models import make_tiny_model

from ._helpers import kv_layers

PROMPT = "You answer briefly and only about the weather. " * 12 + "Is it raining?"
CLI = [sys.executable, "-m", "kvstore.adapters.cli"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("one_key") / "tiny-llama")


def mlx_lm_generate(model, store=None, report=None) -> str:
    """`python -m mlx_lm generate`'s answer, alone or under `kvstore run`."""
    argv = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt", PROMPT,
            "--max-tokens", "8", "--temp", "0"]
    env = dict(os.environ)
    if store is not None:
        argv = [*CLI, "run", "--ssd-path", str(store), "--block-size", "16", "--calibrate-budget-s", "0", "--", *argv]
        env["KVSTORE_RUN_REPORT"] = str(report)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("==========")[1].strip()


def kvstore_generate(model, store, prompt=PROMPT, *options: str, block_size=16) -> tuple[str, int, int]:
    """`kvstore generate`'s answer, the prompt's tokens and how many came from the store (``options``: more of
    its options, a ``--system-prompt``)."""
    done = subprocess.run([*CLI, "generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "8",
                           "--ssd-path", str(store), "--block-size", str(block_size), *options],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    n, stored = map(int, re.search(r"prompt (\d+) tokens: (\d+) from the store", done.stderr).groups())
    return done.stdout.strip(), n, stored


def rendered_chat(model, messages) -> str:
    """The text oMLX's and vllm-mlx's chat endpoints tokenize for ``messages``: the chat template rendered to
    text, then tokenized with the tokenizer's special tokens (``tokenizer.encode``), so a template that writes
    the BOS token itself gets it twice, where mlx-lm (and ``kvstore generate``) tokenize in the template, once.
    ``kvstore generate --ignore-chat-template --prompt TEXT`` tokenizes it as those servers do."""
    from mlx_lm import load

    _, tokenizer = load(str(model))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def inspect_rows(store) -> list[dict]:
    done = subprocess.run([*CLI, "inspect", str(store), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def across_a_server(serve_once, model, messages, tmp_path, block_size: int, server_first: bool) -> None:
    """The lanes' check (tests/test_omlx.py, tests/test_vllm_mlx.py): ``serve_once(store)`` sends ``messages``
    to a server on ``model`` (a folder of that name) and stops it with SIGTERM, giving its response; the same
    tokens through ``kvstore generate`` (``rendered_chat``), before it (``server_first``) or after it on the
    same store: the second is served >= 90% of the prompt from the store, every answer is ``kvstore
    generate``'s on an empty store (the engine's own), and ``inspect`` names the model once."""
    text = rendered_chat(model, messages)

    def generate(store):
        return kvstore_generate(model, store, text, "--ignore-chat-template", block_size=block_size)

    alone, n, stored = generate(tmp_path / "empty")
    assert alone and stored == 0 and n > 10 * block_size  # the whole blocks are >= 90% of the prompt
    store = tmp_path / "store"
    if not server_first:
        assert generate(store) == (alone, n, 0)
    served = serve_once(store)
    usage = served["usage"]
    assert usage["prompt_tokens"] == n  # (the same text, tokenized the same)
    assert served["choices"][0]["message"]["content"] == alone
    if server_first:
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        answer, n_again, stored = generate(store)
        assert (answer, n_again) == (alone, n) and stored >= 0.9 * n
    else:
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * n
    assert {r["model"] for r in inspect_rows(store)} == {Path(model).name}  # one model, by its folder's name


def test_a_prompt_stored_under_kvstore_run_is_served_by_kvstore_generate(model, tmp_path):
    alone = mlx_lm_generate(model)
    store, rep = tmp_path / "store", tmp_path / "report.jsonl"
    assert mlx_lm_generate(model, store, rep) == alone
    text, n, stored = kvstore_generate(model, store)
    assert text == alone
    assert stored >= 0.9 * n
    rows = inspect_rows(store)
    assert {r["model"] for r in rows} == {"tiny-llama"}  # one model, by its folder's name


def test_a_prompt_stored_by_kvstore_generate_is_served_under_kvstore_run(model, tmp_path):
    alone = mlx_lm_generate(model)
    store, rep = tmp_path / "store", tmp_path / "report.jsonl"
    text, _, stored = kvstore_generate(model, store)
    assert text == alone and stored == 0
    assert mlx_lm_generate(model, store, rep) == alone
    (line,) = [json.loads(s) for s in Path(rep).read_text().splitlines()]
    assert line["store_tokens"] >= 0.9 * line["prompt_tokens"]
    assert {r["model"] for r in inspect_rows(store)} == {"tiny-llama"}


def test_a_model_changed_after_loading_is_keyed_by_what_it_holds(model):
    """An engine that quantizes the model it loaded holds other weights than its folder's: it must not share
    the folder's key."""
    import mlx.nn as nn
    from mlx_lm import load

    from kvstore.adapters.generate import model_key
    from kvstore.adapters.mlx_lm import loaded_model_fingerprint

    loaded, _ = load(str(model))
    folder_key = model_key(loaded, model)
    assert model_key(loaded) == folder_key  # the folder mlx-lm's load recorded
    changed, _ = load(str(model))
    nn.quantize(changed, group_size=32, bits=8)
    assert model_key(changed) != folder_key
    assert model_key(changed, model) == model_key(changed) == loaded_model_fingerprint(changed)


# -- what `kvstore inspect` shows, and `kvstore export --model-key` takes ---------------------------------------


@pytest.fixture
def two_models(tmp_path):
    """One model's three prompts sharing a 45-token system prompt (they part within a block), and another
    model whose folder has the same name."""
    from kvstore import PrefixStore

    path = tmp_path / "store"
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16) as store:
        store.register_model("key-a", {"name": "tiny-llama", "path": "/nowhere/tiny-llama"})
        store.register_model("key-b", {"name": "other"})
        for i in range(3):
            tokens = list(range(45)) + [100 + i] * 20
            store.put("key-a", tokens, kv_layers(tokens))
        store.put("key-b", list(range(40)), kv_layers(list(range(40))))
        store.flush()
    return path


def _kvstore(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_inspect_shows_where_entries_that_share_a_system_prompt_differ(two_models):
    rows = inspect_rows(two_models)
    mine = [r for r in rows if r["model"] == "tiny-llama"]
    assert len(mine) == 3 and {r["differs_at"] for r in mine} == {45}
    assert sorted(r["tail_tokens"][0] for r in mine) == [100, 101, 102]
    (other,) = [r for r in rows if r["model"] == "other"]
    assert other["differs_at"] == 0 and other["tail_tokens"] == list(range(16))
    table = _kvstore("inspect", two_models, "--no-decode").stdout
    assert table.count("@45 ") == 3 and "tiny-llama" in table


def test_export_takes_the_name_inspect_shows_and_refuses_an_unknown_one(two_models, tmp_path):
    done = _kvstore("export", two_models, tmp_path / "a.kvx", "--model-key", "tiny-llama")
    assert done.returncode == 0, done.stderr
    assert re.search(r"exported \d+ blocks .* of 1 model \(tiny-llama\)", done.stdout), done.stdout
    assert "exported 0 blocks" not in done.stdout
    unknown = _kvstore("export", two_models, tmp_path / "b.kvx", "--model-key", "no-such-model")
    assert unknown.returncode == 2 and "no-such-model" in unknown.stderr and "tiny-llama" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1 and "Traceback" not in unknown.stderr
    assert not (tmp_path / "b.kvx").exists()


def test_two_models_of_one_folder_name_are_shown_apart():
    from kvstore.admin.catalog import display_names

    names = display_names({b"\x01" * 16: {"name": "m"}, b"\x02" * 16: {"name": "m"}, b"\x03" * 16: {"name": "n"}})
    assert names == {b"\x01" * 16: "m@01010101", b"\x02" * 16: "m@02020202", b"\x03" * 16: "n"}
