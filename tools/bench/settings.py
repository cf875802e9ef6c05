"""What each mode runs (sizes per part) and the targets the summary checks."""

from __future__ import annotations

from typing import Any

PARTS = ("restore", "lookup", "put", "ttft", "replay", "fidelity")

SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        repeats=2,
        machine=dict(add_elements=1 << 20, matmul=256),
        restore=dict(layers=2, heads=2, dim=64, tokens=512),
        lookup=dict(tokens=16384, filler=20_000, repeats=20),
        put=dict(layers=2, heads=2, dim=64, tokens=4096, q8_tokens=1024),
        ttft=dict(lengths=[256], hit_repeats=2),
        replay=dict(sys_lens=[256, 192], sys_p=[0.6, 0.4], sessions=3, concurrency=2, chat_turns=(2, 3),
                    user=(8, 32), resp=(8, 16), agent_turns=(2, 3), tool=(16, 48), action=(4, 8),
                    agent_frac=0.34, budget_fracs=[0.25]),
        fidelity=dict(kinds=["llama"], codecs=[None, 8], prompts=1, prompt_len=300, prefix=256, gen=4),
    ),
    "quick": dict(
        repeats=3,
        machine=dict(add_elements=16 << 20, matmul=1024),
        restore=dict(layers=8, heads=8, dim=128, tokens=2048),
        lookup=dict(tokens=131072, filler=200_000, repeats=50),
        put=dict(layers=4, heads=8, dim=128, tokens=32768, q8_tokens=4096),
        ttft=dict(lengths=[1024, 4096], hit_repeats=5),
        replay=dict(sys_lens=[768, 512, 384], sys_p=[0.5, 0.3, 0.2], sessions=12, concurrency=4, chat_turns=(2, 5),
                    user=(24, 96), resp=(16, 64), agent_turns=(3, 6), tool=(48, 192), action=(8, 32),
                    agent_frac=0.4, budget_fracs=[0.25, 0.1]),
        fidelity=dict(kinds=["llama", "gemma3_text", "qwen3_next"], codecs=[None, 8, 6, 4, (8, 4)], prompts=2,
                      prompt_len=600, prefix=512, gen=8),
    ),
    "full": dict(
        repeats=5,
        machine=dict(add_elements=16 << 20, matmul=1024),
        restore=dict(layers=32, heads=8, dim=128, tokens=2048),
        lookup=dict(tokens=131072, filler=1_000_000, repeats=100),
        put=dict(layers=32, heads=8, dim=128, tokens=32768, q8_tokens=4096),
        ttft=dict(lengths=[1024, 4096, 16384], hit_repeats=5),
        replay=dict(sys_lens=[1536, 1024, 768], sys_p=[0.5, 0.3, 0.2], sessions=24, concurrency=6, chat_turns=(3, 7),
                    user=(32, 160), resp=(24, 128), agent_turns=(4, 9), tool=(64, 384), action=(16, 48),
                    agent_frac=0.4, budget_fracs=[0.25, 0.1]),
        fidelity=dict(kinds=["llama", "gemma3_text", "qwen3_next"], codecs=[None, 8, 6, 4, (8, 4)], prompts=6,
                      prompt_len=600, prefix=512, gen=16),
    ),
}

TARGETS = {
    "restore_ram_vs_memcpy": 0.5,
    "restore_ssd_warm_vs_read": 0.4,
    "restore_ssd_cold_vs_read": 0.7,
    "lookup_ms": 1.0,
    "put_block_ms": 1.0,
    "replay_recompute_vs_lru": 1 / 3,
}
