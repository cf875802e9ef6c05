"""The benchmarks run end to end at smoke sizes (``python -m kvstore.tools.bench``
and ``kvstore bench``), write the JSON they promise, and the docs page takes
its figures from the results.

Only structure is checked: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from kvstore.tools.bench import PARTS, report
from kvstore.tools.bench.restore import SHIPPED


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Every part at smoke sizes, one repeat, with the docs page written to a scratch folder."""
    d = tmp_path_factory.mktemp("bench")
    args = ["--smoke", "--repeats", "1", "--out", d / "out", "--tmp", d, "--write-docs", "--docs", d / "docs"]
    proc = subprocess.run([sys.executable, "-m", "kvstore.tools.bench", *map(str, args)], cwd=d, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d, proc, json.loads((d / "out" / "results.json").read_text())


def test_every_part_writes_its_json(smoke):
    d, proc, results = smoke
    assert results["meta"]["mode"] == "smoke" and results["meta"]["parts"] == list(PARTS)
    assert set(results["parts"]) == set(PARTS)
    for part in PARTS:
        assert json.loads((d / "out" / f"{part}.json").read_text()) == results["parts"][part]
    assert sorted(results["meta"]["plots"]) == ["replay.png", "restore.png", "ttft.png"]

    restore = results["parts"]["restore"]
    assert set(restore["entries"]) == {"fp16", "q8", "q4"}
    for e in restore["entries"].values():
        assert e["ram"]["gbps"] > 0 and e["ssd_cold"]["gbps"] > 0 and e["baselines"]["read_cold"]["gbps"] > 0
    assert restore["entries"]["fp16"]["ssd_page_cached_numpy_assemble"]["median_s"] > 0
    assert restore["entries"]["q8"]["dequant_paths"][SHIPPED]["max_abs_diff_vs_mx_dequantize"] == 0

    lookup = results["parts"]["lookup"]
    for key in ("hash_only_np", "walk_only", "walk_only_prompt_index", "contains_np", "contains_list", "fetch_full"):
        assert lookup[key]["median_s"] > 0
    assert lookup["blocks_indexed"] > lookup["store_blocks"] == lookup["prompt_blocks"] > 0
    assert isinstance(lookup["met"], bool)

    put = results["parts"]["put"]
    for key in ("blocking_ssd_store", "blocking_ram_store", "blocking_already_stored", "background_to_ssd",
                "plain_write_fsync"):
        assert put[key]["median_s"] > 0
    assert put["q8"]["blocking"]["median_s"] > 0 and isinstance(put["met"], bool)

    for e in results["parts"]["ttft"]["lengths"].values():
        assert e["kvstore_ram"]["cached_tokens"] > 0 and e["cold"]["median_s"] > 0
    replay = results["parts"]["replay"]
    assert replay["ideal"]["recomputed_tokens"] <= replay["systems"]["kvstore_q8_ssd"]["recomputed_tokens"]
    assert set(results["parts"]["fidelity"]["models"]["llama"]) == {"fp16", "8-bit"}


def test_docs_page_takes_its_figures_from_the_results(smoke):
    d, proc, results = smoke
    page = (d / "docs" / "benchmarks.md").read_text()
    assert sorted(p.name for p in (d / "docs" / "bench").iterdir()) == ["replay.png", "restore.png", "ttft.png"]
    assert "python -m kvstore.tools.bench" in page and "tools/bench.py" not in page
    lookup = results["parts"]["lookup"]
    ms = lookup["contains_np"]["median_s"] * 1e3
    assert f"takes {ms:.3f} ms for an int32 array" in page
    assert f"{lookup['blocks_indexed']:,} blocks" in page
    speed = results["meta"]["mlx_speed"]
    assert f"an fp16 add at {speed['fp16_add_gbps']:.2f} GB/s" in page

    # other figures, another page: nothing in it was typed in
    slower = copy.deepcopy(results)
    slower["parts"]["lookup"]["contains_np"]["median_s"] = 2 * lookup["target_ms"] / 1e3
    slower["parts"]["lookup"]["met"] = False
    slower["meta"]["mlx_speed"]["fp16_add_gbps"] = 123.45
    other = report.write_docs(slower["parts"], slower["meta"], d / "out", d / "other-docs").read_text()
    assert f"takes {2 * lookup['target_ms']:.3f} ms for an int32 array (over the" in other
    assert "an fp16 add at 123.45 GB/s" in other
    assert f"takes {ms:.3f} ms for an int32 array" not in other


def test_kvstore_bench_command_runs_a_part_and_merges_the_rest(smoke, tmp_path):
    from typer.testing import CliRunner

    from kvstore.adapters.cli import app

    d, _, first = smoke
    args = ["bench", "--smoke", "--repeats", "1", "--only", "lookup", "--out", tmp_path / "out", "--tmp", tmp_path,
            "--merge", d / "out" / "results.json"]
    proc = CliRunner().invoke(app, list(map(str, args)))
    assert proc.exit_code == 0, proc.output[-3000:]
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(merged["parts"]) == list(PARTS)
    assert merged["meta"]["parts"] == ["lookup"] and merged["meta"]["merged_from"] == str(d / "out" / "results.json")
    assert merged["parts"]["lookup"]["contains_np"] != first["parts"]["lookup"]["contains_np"]  # run again
    assert merged["parts"]["put"] == first["parts"]["put"]  # taken over
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["replay.png", "restore.png", "ttft.png"]
    assert "results in" in proc.output and "wrote" not in proc.output  # no --write-docs: no docs page


def test_cost_bench_runs_each_policy_after_each_policy_equally_often():
    from collections import Counter

    from kvstore.tools.cost_bench import POLICIES, request_order
    for repeats in (3, 6, 9):
        order = request_order(repeats)
        assert Counter(order) == {p: repeats for p in POLICIES}
        pairs = Counter(zip(order, order[1:] + order[:1]))  # cyclically: the next row starts the cycle again
        assert pairs == {(a, b): repeats // 3 for a in POLICIES for b in POLICIES}
    for unequal in (1, 2, 4):  # part of a cycle would run the policies unequally often
        with pytest.raises(ValueError):
            request_order(unequal)


def test_put_cost_gc_pauses_and_the_issue_table_run_and_write_their_json(tmp_path):
    """``tools/put_cost.py``, ``tools/gc_pauses.py`` and ``tools/hot_path_table.py`` (run on GPUs against old
    trees too) work end to end."""
    from kvstore.adapters.tiny_models import ensure_tiny_model
    put = subprocess.run([sys.executable, "-m", "kvstore.tools.put_cost", "--tokens", "300", "--repeats", "1",
                          "--layers", "2", "--heads", "2", "--dim", "16", "--first-puts", "1", "--pause", "0.01",
                          "--out", str(tmp_path / "put")], capture_output=True, text=True, timeout=300)
    assert put.returncode == 0, put.stderr[-3000:]
    got = json.loads((tmp_path / "put" / "put.json").read_text())
    (row,) = got["rows"]
    assert row["tokens"] == 300 and row["store_cache_ms"] > 0 and row["insert_ms"] > 0
    assert len(got["first_puts_ms"]) == 1 and got["first_puts_ms"][0] > 0 and got["pause_s"] == 0.01
    gc = subprocess.run([sys.executable, "-m", "kvstore.tools.gc_pauses", "--tokens", "600", "--puts", "2",
                         "--layers", "2", "--heads", "1", "--dim", "16", "--out", str(tmp_path / "gc.json")],
                        capture_output=True, text=True, timeout=300)
    assert gc.returncode == 0, gc.stderr[-3000:]
    got = json.loads((tmp_path / "gc.json").read_text())
    assert got["ram_blocks"] == 2 * 3 and got["tracked_objects_per_block"] > 0 and set(got["gen2"]) == {
        "count", "total_ms", "longest_ms"}
    model = ensure_tiny_model("llama", max_position_embeddings=1024)
    table = subprocess.run([sys.executable, "-m", "kvstore.tools.hot_path_table", "--model", str(model), "--rows",
                            "300:q4", "--repeats", "1", "--dir", str(tmp_path), "--out", str(tmp_path / "t.json")],
                           capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr[-3000:]
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["ram"]["cached_tokens"] == row["ssd_cached"]["cached_tokens"] == row["ssd_cold"]["cached_tokens"] == 299
    assert row["cold"]["cached_tokens"] == 0 and row["ssd_cached"]["ram_tokens"] == 0
