"""kvstore benchmarks: the CPU suite (restore, lookup, put, ttft, replay,
fidelity) and the benchmarks with options of their own.

    python -m kvstore.tools.bench [--quick | --smoke] [--only PART ...] [--out DIR]
                                  [--repeats N] [--tmp DIR] [--write-docs] [--merge RESULTS_JSON]
    kvstore bench ...                     (the same options)
    kvstore bench NAME [options]          (one of ``run.BENCHES``: ssd, cost, remote, ...; NAME --help)

Every figure is a median over repeats, and every figure that has a baseline
(memcpy, a plain file read, a cold prefill, mlx-lm's ``LRUPromptCache``) has it
measured in the same run, so the ratios are what to read: absolute numbers
depend on the machine (mlx on a Linux CPU is far slower than on Apple silicon).

Writes ``DIR/<part>.json``, ``DIR/results.json`` and ``DIR/*.png`` (default
``bench-out/``); a full run (or ``--write-docs``) also writes
``docs/benchmarks.md`` and copies the plots to ``docs/bench/``.

Parts (one module each, ``run(cfg, repeats, tmp) -> dict``):

restore   fetch GB/s from the RAM tier and the SSD tier (page-cached and cold)
          for fp16 / 8-bit / 4-bit entries of a Llama-3-8B-shaped layer set,
          vs memcpy and vs a plain read of a file of the same size; quantized
          hand-over vs dequantize, and faster dequantize paths.
lookup    index walk + key hashing of a 128K-token prompt against 1M blocks.
put       how long ``put`` blocks the caller for a 32K-token cache, and the
          background throughput to SSD.
ttft      time to first token on the tiny llama: cold prefill vs kvstore RAM /
          SSD hit vs mlx-lm ``LRUPromptCache`` hit.
replay    a seeded multi-user chat / agent trace under one RAM byte budget:
          LRUPromptCache vs kvstore fp16 vs q8 vs q8 + SSD (real model runs).
fidelity  logit error, KL and top-1 / greedy agreement of quantized entries on
          the tiny llama, gemma3_text and qwen3_next models.

The named benchmarks are modules here too (``ssd``, ``cost``, ``calibration``,
``fingerprint``, ``evict``, ``remote``, ``gc_pauses``, ``fetch_path``, ``new_shapes``, ``run_ttft`` with the
engines it times, ``vllm_mlx_replay``, ``vllm_mlx_ttft``) or beside this
package (``kvstore.tools.put_cost``, ``kvstore.tools.fidelity``), each with a
``main(argv)``; docs/benchmarks.md gives each one's command, machine and table.

The live replay of ``kvstore.tools.live_replay`` has its parts here too:
``live_traces``, ``live_run`` (one process's replays), ``live_summary``,
``live_serve`` (through the servers) and ``llama_8b`` (the 8B-shaped model of
the GPU figures).

Around them: ``settings`` (sizes per mode, targets), ``common`` (timing,
baselines, tokens and KV, tiny models, the machine), ``plots``, ``report``
(summary table and the docs page) with ``notes`` (the reading notes; every
number in both is taken from the results) and ``run`` (options, the run, the
JSON). ``main(argv=None)`` returns 0 (the
``kvstore bench`` command calls it).
"""

from .run import BENCHES, main, parse_args
from .settings import PARTS

__all__ = ["BENCHES", "main", "parse_args", "PARTS"]
