"""Cold fetches by policy, in turn: does anything a policy does at open or in
its fetch change what a cold read costs? (issue 28)

One prompt's KV (random fp16 rows of Llama-3-8B's shape) is stored once;
then, round after round, each variant reopens the store on the file after
dropping it from the page cache and times one fetch of the whole prompt
(ready arrays; on CUDA on the device): ``always``; ``always`` after the cold
probe ``fetch_policy="auto"`` runs at open (``probe.direct_read_rate``);
``auto`` (which probes at open); ``auto`` with a configured prior (no probe).
The order turns each round, and the share of the file resident just after
open is recorded: an open that read blocks around its index pages made every
other cold fetch partly cached (fixed in 40f3494).

    python -m kvstore.tools.cold_policy_ab --tokens 8192 --kv q4 --rounds 8 --out OUT/cold.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore import PrefixStore
from kvstore.cost.model import probe
from kvstore.config import StoreConfig
from kvstore.tools.bench.common import drop_page_cache, resident_fraction, write_json
from kvstore.tools.ssd_bench import KV, _layers, _ready

VARIANTS = ("always", "always_after_probe", "auto", "auto_no_probe")


def run(tokens: int, kind: str, rounds: int, tmp: Path) -> dict:
    bits = KV[kind]
    d = Path(tempfile.mkdtemp(dir=tmp))
    try:
        prompt = np.arange(5, tokens + 5, dtype=np.int32)
        with PrefixStore(budget_gb=0, ssd_path=d, kv_bits=bits) as s:
            s.put("m", prompt, _layers(tokens, 32, 8, 128))
            s.flush()
            stored = s.stats()["ssd_bytes"]
        data = d / "data.mdb"
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        resident: list[float] = []
        for r in range(rounds):
            for name in VARIANTS[r % 4:] + VARIANTS[: r % 4]:
                drop_page_cache(data)
                kw: dict = dict(fetch_policy="auto" if name.startswith("auto") else "always")
                if name == "auto_no_probe":
                    kw["prior_ssd_cold_gbps"] = 1.5
                with PrefixStore(budget_gb=0, device_budget_gb=0, ssd_path=d, kv_bits=bits, remember_rates=False,
                                 **kw) as s:
                    if name == "always_after_probe":
                        probe.direct_read_rate(data, 4 * StoreConfig().probe_bytes)
                    resident.append(round(resident_fraction(data), 3))
                    mx.clear_cache()
                    t = time.perf_counter()
                    hit = s.fetch("m", prompt, limit=tokens - 1)
                    _ready(hit)
                    times[name].append(round(1e3 * (time.perf_counter() - t), 1))
                    assert hit.length == tokens - 1 and hit.ssd_tokens == tokens - 1, hit
        return {"tokens": tokens, "kv": kind, "stored_bytes": stored, "device": str(mx.default_device()),
                "date": time.strftime("%Y-%m-%d %H:%M"), "resident_after_open": resident,
                "median_ms": {k: statistics.median(v) for k, v in times.items()}, "each_ms": times}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cold_policy_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv", default="q4", choices=list(KV))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the store goes (a real disk)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res = run(args.tokens, args.kv, args.rounds, args.dir)
    print(json.dumps(res))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
