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


def kvstore_generate(model, store) -> tuple[str, int, int]:
    """`kvstore generate`'s answer, the prompt's tokens and how many came from the store."""
    done = subprocess.run([*CLI, "generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "8",
                           "--ssd-path", str(store), "--block-size", "16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    n, stored = map(int, re.search(r"prompt (\d+) tokens: (\d+) from the store", done.stderr).groups())
    return done.stdout.strip(), n, stored


def inspect_rows(store) -> list[dict]:
    done = subprocess.run([*CLI, "inspect", str(store), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


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
