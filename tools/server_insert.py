"""What ``insert_cache`` costs mlx-lm's server's generation thread.

mlx-lm's server inserts a request's prompt cache on its generation thread,
after the response is sent and before the next request is served, so every
microsecond there delays the next request. This runs mlx-lm's real server (in
this process, on loopback, the tiny llama model) once per prompt cache and
sends the same ``--requests`` chats to each (a shared system prompt, then a
question of its own), timing every ``insert_cache`` call the server makes:

- ``mlx-lm LRUPromptCache``: mlx-lm's own (keeps the cache objects as they are);
- ``store, put on the engine thread``: the store's insert as it was before
  (copy the rows, wait for the last step, hash and queue, all on that thread);
- ``store``: ``StorePromptCache`` now (views of the rows and a hand-off; the
  copy and the put run on a thread of their own).

    python tools/server_insert.py [--requests 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from mlx_lm.models.cache import LRUPromptCache

from kvstore.adapters.mlx_lm import cache_offset, cache_to_layers
from kvstore.adapters.server import StorePromptCache, start
from kvstore.adapters.tiny_models import ensure_tiny_model

SYSTEM = "You are a helpful assistant who answers briefly. " * 30


class _PutOnEngineThread(StorePromptCache):
    """The insert as it was before: copies and ``PrefixStore.put`` in the caller."""

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        m = self._resolve(model)
        n = cache_offset(prompt_cache)
        self.store.put(m.key, list(tokens[:n]), cache_to_layers(prompt_cache))


def _timed(cache: Any, times: list[float]) -> Any:
    insert = cache.insert_cache

    def timed(*args, **kwargs):
        t = time.perf_counter()
        insert(*args, **kwargs)
        times.append(time.perf_counter() - t)

    cache.insert_cache = timed
    return cache


def _chat(port: int, question: str) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["usage"]


def run(name: str, make_cache: Callable[[Any], Any], model: Path, requests: int, tmp: Path) -> dict:
    server = start(["--model", str(model), "--port", "0", "--ssd-path", str(tmp / name.replace(" ", "-")),
                    "--log-level", "WARNING"])
    times: list[float] = []
    # the prompt cache the generation thread uses: read from this attribute at every request
    server.generator.prompt_cache = _timed(make_cache(server), times)
    server.serve_in_thread()
    usage = []
    with contextlib.ExitStack() as stack:
        stack.callback(server.close)
        for i in range(requests):
            usage.append(_chat(server.port, f"question number {i}: what is new?"))
    ts = sorted(times[2:])  # the first inserts pay one-time costs (thread start, first allocation)
    return {"name": name, "inserts": len(ts), "median_ms": statistics.median(ts) * 1e3,
            "p90_ms": ts[int(0.9 * (len(ts) - 1))] * 1e3, "prompt_tokens": usage[-1]["prompt_tokens"],
            "cached_tokens_median": statistics.median(u["prompt_tokens_details"]["cached_tokens"] for u in usage[1:])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.getLogger("kvstore").setLevel(logging.WARNING)
    model = ensure_tiny_model("llama")
    variants = {
        "mlx-lm LRUPromptCache": lambda s: LRUPromptCache(),
        "store, put on the engine thread": lambda s: _PutOnEngineThread(s.store, s.prompt_cache.provider),
        "store": lambda s: s.prompt_cache,
    }
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, make, model, args.requests, Path(tmp)) for name, make in variants.items()]
    base = results[0]["median_ms"]
    print(f"insert_cache on the generation thread, tiny llama, {args.requests} requests each "
          f"({results[0]['prompt_tokens']}-token prompts sharing a system prompt, 8 tokens generated):")
    for r in results:
        print(f"  {r['name']:<34} median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms  "
              f"({r['median_ms'] / base:.1f}x mlx-lm)  inserts {r['inserts']}  "
              f"cached tokens per request (median) {r['cached_tokens_median']:.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
