"""Child process for test_restart: ``python -m tests._restart_child MODE PATH``.

MODE is ``write-close`` (put, then close()), ``write-exit`` (put, then leave the
interpreter with writes still queued: only the atexit flush saves them) or
``read`` (open the store anew and check every prompt comes back exactly).
"""

from __future__ import annotations

import json
import sys

from kvstore.store import PrefixStore

from ._helpers import assert_hit_is, kv_layers

BS = 8
DIM = 64
MODEL = "restart-model"


def prompts() -> list[list[int]]:
    """Prompts sharing prefixes, full and partial blocks, one longer than the rest."""
    base = list(range(100, 120))
    out = [base[:5], base, base + [7] * 13, base[:12] + [9, 9, 9], list(range(500, 620))]
    return out


def layers(p):
    return kv_layers(p, n_layers=2, heads=2, dim=DIM)


def main(mode: str, path: str) -> None:
    if mode.startswith("write"):
        store = PrefixStore(budget_gb=1, ssd_path=path, block_size=BS, disk_budget_gb=1)
        if mode == "write-close":
            for p in prompts():
                store.put(MODEL, p, layers(p))
            store.close()
            print(json.dumps({"closed": True}))
            return
        # Hold the writer while putting and leaving: it cannot encode
        # anything yet, so every block is still queued at exit.
        with store.pause_writer():
            for p in prompts():
                store.put(MODEL, p, layers(p))
            pending = store.stats()["pending_bytes"]
            print(json.dumps({"pending_bytes": pending}), flush=True)
            raise SystemExit(0)  # no close(), no flush(): the atexit hook must write everything
    if mode == "read":
        store = PrefixStore(budget_gb=1, ssd_path=path, block_size=BS, kv_bits=4)  # other settings
        for i, p in enumerate(prompts()):
            hit = store.fetch(MODEL, p)
            assert_hit_is(hit, p, len(p), heads=2, dim=DIM)
            if i == 0:
                assert hit.ssd_tokens == len(p), "a fresh process reads from SSD"
        again = store.fetch(MODEL, prompts()[0])
        assert again.ram_tokens == len(prompts()[0]), "blocks read from SSD are promoted to RAM"
        print(json.dumps({"blocks": len(store), "orphans": store.orphans}))
        store.close()
        return
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
