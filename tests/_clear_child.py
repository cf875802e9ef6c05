"""Child process for test_cli's clear-beside-an-engine test:
``python -m tests._clear_child PATH``. Puts a prompt, says ``ready`` and
waits for a line on stdin (the parent clears the store meanwhile); then puts
a longer prompt over the cleared one twice and prints what it sees."""

from __future__ import annotations

import json
import sys

from kvstore.store import PrefixStore

from ._helpers import kv_layers

MODEL = "clear-child-model"
SHORT = list(range(64))
LONG = SHORT + list(range(500, 564))


def main(path: str) -> None:
    with PrefixStore(budget_gb=0.1, ssd_path=path, block_size=16) as store:
        store.put(MODEL, SHORT, kv_layers(SHORT))
        store.flush()
        print("ready", flush=True)
        sys.stdin.readline()
        first = store.put(MODEL, LONG, kv_layers(LONG))  # over blocks the clear removed from disk
        store.flush()
        second = store.put(MODEL, LONG, kv_layers(LONG))
        store.flush()
        print(json.dumps({"first": first, "second": second, "fetched": store.fetch(MODEL, LONG).length}))


if __name__ == "__main__":
    main(sys.argv[1])
