"""tools/bench.py runs end to end at smoke sizes and writes the JSON it promises.

Only structure is checked: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke_lookup_and_put(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "--smoke", "--only", "lookup", "put",
         "--out", str(out), "--tmp", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["mode"] == "smoke"
    assert results["meta"]["parts"] == ["lookup", "put"]
    assert set(results["parts"]) == {"lookup", "put"}

    lookup = json.loads((out / "lookup.json").read_text())
    for key in ("hash_only_np", "walk_only", "contains_np", "contains_list", "fetch_full"):
        assert lookup[key]["median_s"] > 0
    assert lookup["blocks_indexed"] > lookup["prompt_blocks"] > 0
    assert isinstance(lookup["met"], bool)

    put = json.loads((out / "put.json").read_text())
    for key in ("blocking_ssd_store", "blocking_ram_store", "blocking_already_stored", "background_to_ssd",
                "plain_write_fsync"):
        assert put[key]["median_s"] > 0
    assert put["background_to_ssd"]["gbps"] > 0
    assert put["q8"]["blocking"]["median_s"] > 0
    assert isinstance(put["met"], bool)

    # nothing but a run without --write-docs: docs/benchmarks.md is not touched
    assert "wrote" not in proc.stderr


def test_bench_is_importable():
    sys.path.insert(0, str(ROOT))
    try:
        from kvstore.tools import bench
    finally:
        sys.path.remove(str(ROOT))
    assert callable(bench.main)
    assert set(bench.PARTS) == {"restore", "lookup", "put", "ttft", "replay", "fidelity"}
    args = bench.parse_args(["--quick", "--only", "lookup", "--out", "x"])
    assert args.quick and args.only == ["lookup"] and args.out == "x"
