"""The live replay's traces (issue 42): ``make_trace``'s settings by name, one seed for all, so a
replay and the servers' run of the same name see the same sessions, and what a result records of one."""

from __future__ import annotations

from typing import Any

from .replay import make_trace, seen_prefixes

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


# the warm-up trace's lengths against the measured one's (``--rounds warm-engine``): each system prompt
# longer by SHIFT_SYSTEM tokens (not a multiple of a block), each segment's range by SHIFT_SEGMENT
SHIFT_SYSTEM, SHIFT_SEGMENT = 97, 13


def warm_up_trace(name: str, measured: dict, tries: int = 50) -> tuple[dict, dict]:
    """(trace, settings) of another trace for warming the engine before the measured one: ``name``'s
    settings with every length shifted (``SHIFT_SYSTEM``, ``SHIFT_SEGMENT``) and the first seed after
    ``SEED`` whose prompt lengths are none of ``measured``'s, so that no prompt of it runs the measured
    prompts' (cached 0, new tokens) shapes (the fewest shared where ``tries`` seeds find none);
    ``settings`` records the seed, the shifts and the lengths shared."""
    c = dict(TRACES[name])
    c["sys_lens"] = [n + SHIFT_SYSTEM for n in c["sys_lens"]]
    for k in ("user", "resp", "tool", "action"):
        c[k] = (c[k][0] + SHIFT_SEGMENT, c[k][1] + SHIFT_SEGMENT)
    lengths = {len(r["prompt"]) for r in measured["requests"]}
    best: tuple[int, int, dict] = (-1, 0, {})
    for seed in range(SEED + 1, SEED + 1 + tries):
        t = make_trace(c, seed)
        shared = len(lengths & {len(r["prompt"]) for r in t["requests"]})
        if best[0] < 0 or shared < best[0]:
            best = (shared, seed, t)
        if not shared:
            break
    shared, seed, t = best
    return t, {**c, "seed": seed, "shift_system": SHIFT_SYSTEM, "shift_segment": SHIFT_SEGMENT,
               "prompt_lengths_shared": shared, "requests": len(t["requests"]), "prompt_tokens": t["prompt_tokens"]}


def first_sight_tokens(trace: dict) -> list[int]:
    """Per request, the tokens of its prompt no cache could have had: those past the longest prefix an
    earlier prompt + response of the trace began with (their first sight in the trace's order), and at
    least the last token (an engine computes it for the first token's logits). Any cache's computed
    tokens are at least these, request by request (kvstore's too: it serves a prompt's tail to the token)."""
    return [len(r["prompt"]) - min(seen, len(r["prompt"]) - 1)
            for r, seen in zip(trace["requests"], seen_prefixes(trace["requests"]))]


def describe(name: str, trace: dict) -> dict:
    """What a result records of the trace it replayed: its settings and its sizes."""
    return {"name": name, "seed": SEED, **TRACES[name], "requests": len(trace["requests"]),
            "sessions": len(trace["sessions"]), "chat_sessions": trace["n_chat"], "agent_sessions": trace["n_agent"],
            "prompt_tokens": trace["prompt_tokens"], "longest": max(len(r["prompt"]) for r in trace["requests"]),
            "unique_tokens": trace["unique_tokens"], "ideal_cached_tokens": trace["ideal_cached_tokens"],
            "first_sight_tokens": sum(first_sight_tokens(trace))}
