"""The live replay's traces (issue 42): ``make_trace``'s settings by name, one seed for all, so a
replay and the servers' run of the same name see the same sessions, and what a result records of one."""

from __future__ import annotations

from typing import Any

from .replay import make_trace

SEED = 50
# "gpu45": docs/benchmarks.md's H200 replay table (the former tools/replay_gpu.py's "gpu"): 45 requests,
# 262,973 prompt tokens, longest 11,528, unique KV 5.6 GiB fp16 on the 8B shape. "gpu": the H200 figures through
# the servers: 43 requests, 269,984 tokens, longest 14,449, 59,110 unique tokens (7.2 GiB). "cpu": 28 requests,
# 20,692 tokens; "smoke": 11 requests, 5,852 tokens.
TRACES: dict[str, dict[str, Any]] = {
    "gpu45": dict(sys_lens=[4096, 2048], sys_p=[0.5, 0.5], sessions=10, concurrency=4, chat_turns=(3, 5),
                  user=(100, 600), resp=(100, 400), agent_turns=(4, 6), tool=(300, 1600), action=(50, 200),
                  agent_frac=0.5),
    "gpu": dict(sys_lens=[4096, 2048], sys_p=[0.5, 0.5], sessions=10, concurrency=4, chat_turns=(2, 5),
                user=(64, 384), resp=(128, 512), agent_turns=(4, 7), tool=(768, 1792), action=(128, 384),
                agent_frac=0.5),
    "cpu": dict(sys_lens=[512, 256], sys_p=[0.5, 0.5], sessions=8, concurrency=4, chat_turns=(2, 4), user=(16, 64),
                resp=(32, 96), agent_turns=(3, 5), tool=(64, 224), action=(16, 48), agent_frac=0.5),
    "smoke": dict(sys_lens=[512, 256], sys_p=[0.5, 0.5], sessions=4, concurrency=2, chat_turns=(2, 3), user=(8, 32),
                  resp=(8, 24), agent_turns=(2, 3), tool=(32, 96), action=(8, 16), agent_frac=0.5),
}


def load_trace(name: str) -> dict:
    """The named trace's sessions and requests (``make_trace``)."""
    return make_trace(TRACES[name], SEED)


def describe(name: str, trace: dict) -> dict:
    """What a result records of the trace it replayed: its settings and its sizes."""
    return {"name": name, "seed": SEED, **TRACES[name], "requests": len(trace["requests"]),
            "sessions": len(trace["sessions"]), "chat_sessions": trace["n_chat"], "agent_sessions": trace["n_agent"],
            "prompt_tokens": trace["prompt_tokens"], "longest": max(len(r["prompt"]) for r in trace["requests"]),
            "unique_tokens": trace["unique_tokens"], "ideal_cached_tokens": trace["ideal_cached_tokens"]}
