"""An engine beside ``kvstore import``: ``python -m tests._import_child PATH``.

Opens the store at PATH writable, puts a prompt of its own, says ``ready``,
then at each line on stdin fetches the prompts given there (a JSON list of
token lists) and prints what it served, each checked bit-exact against the
KV ``_helpers.kv_layers`` makes (an assertion fails the process otherwise).
"""

from __future__ import annotations

import json
import sys

from kvstore.store import PrefixStore

from ._helpers import assert_hit_is, kv_layers

MODEL = "import-model"
BS = 16


def main(path: str) -> None:
    store = PrefixStore(budget_gb=0.1, ssd_path=path, block_size=BS)
    own = list(range(900, 940))
    store.put(MODEL, own, kv_layers(own))
    store.flush()
    print("ready", flush=True)
    for line in sys.stdin:
        served = []
        for p in json.loads(line):
            hit = store.fetch(MODEL, p)
            if hit.length:
                assert_hit_is(hit, p, hit.length)
            served.append(hit.length)
        hit = store.fetch(MODEL, own)
        assert_hit_is(hit, own, len(own))
        print(json.dumps(served), flush=True)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1])
