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

    from kvstore.tools.bench.cost import POLICIES, request_order
    for repeats in (3, 6, 9):
        order = request_order(repeats)
        assert Counter(order) == {p: repeats for p in POLICIES}
        pairs = Counter(zip(order, order[1:] + order[:1]))  # cyclically: the next row starts the cycle again
        assert pairs == {(a, b): repeats // 3 for a in POLICIES for b in POLICIES}
    for unequal in (1, 2, 4):  # part of a cycle would run the policies unequally often
        with pytest.raises(ValueError):
            request_order(unequal)


def test_every_named_benchmark_answers_its_help(capsys):
    """``kvstore bench NAME --help``: each named benchmark's module imports and parses its options."""
    from kvstore.tools.bench.run import BENCHES, main

    for name in BENCHES:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in BENCHES)  # the suite's help lists them


def test_put_cost_and_gc_pauses_run_and_write_their_json(tmp_path):
    """``kvstore bench put-cost`` and ``gc-pauses`` (run on GPUs against old trees too) work end to end."""
    put = subprocess.run([sys.executable, "-m", "kvstore.tools.put_cost", "--tokens", "300", "--repeats", "1",
                          "--layers", "2", "--heads", "2", "--dim", "16", "--first-puts", "1", "--pause", "0.01",
                          "--out", str(tmp_path / "put")], capture_output=True, text=True, timeout=300)
    assert put.returncode == 0, put.stderr[-3000:]
    got = json.loads((tmp_path / "put" / "put.json").read_text())
    (row,) = got["rows"]
    assert row["tokens"] == 300 and row["store_cache_ms"] > 0 and row["insert_ms"] > 0
    assert len(got["first_puts_ms"]) == 1 and got["first_puts_ms"][0] > 0 and got["pause_s"] == 0.01
    gc = subprocess.run([sys.executable, "-m", "kvstore.tools.bench", "gc-pauses", "--tokens", "600", "--puts", "2",
                         "--layers", "2", "--heads", "1", "--dim", "16", "--out", str(tmp_path / "gc.json")],
                        capture_output=True, text=True, timeout=300)
    assert gc.returncode == 0, gc.stderr[-3000:]
    got = json.loads((tmp_path / "gc.json").read_text())
    assert got["ram_blocks"] == 2 * 3 and got["tracked_objects_per_block"] > 0 and set(got["gen2"]) == {
        "count", "total_ms", "longest_ms"}


def test_new_shapes_runs_each_setting_in_its_own_process_and_compares_outputs(tmp_path):
    """``kvstore bench new-shapes`` (a GPU's figures) at a tiny size on this machine: each setting's process with
    its variables, every shape timed and digested, and outputs compared with the first setting's (no CUDA here:
    nothing throws, and the check-off settings give the same bits)."""
    out = tmp_path / "ns.json"
    proc = subprocess.run([sys.executable, "-m", "kvstore.tools.bench", "new-shapes", "--parts", "sdpa", "prefill",
                           "--settings", "mlx-default", "check-off", "check-off-late", "--shapes", "3", "--low", "20",
                           "--high", "60", "--repeat-every", "2", "--hidden", "256", "--layers", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    for part in ("sdpa", "prefill"):
        default, off, late = got["parts"][part]["summary"]
        check = [s["env"]["MLX_ENABLE_CACHE_THRASHING_CHECK"] for s in (default, off, late)]
        assert check == ["1", "0", "0"]  # (late: as the child saw it, after turning it off)
        for s in (default, off, late):
            assert s["survived"] and s["shapes_done"] == 3 and s["new_ms_median"] > 0 and s["again_ms_median"] > 0
        assert off["outputs_equal"] == late["outputs_equal"] == 1.0 and off["compared_shapes"] == 3
        assert len({r["n"] for r in got["parts"][part]["shapes"]["check-off"]}) == 3
    assert got["parts"]["prefill"]["summary"][1]["next_token_equal"] == 1.0


def test_live_replay_runs_each_cache_in_its_own_process_and_writes_rows_and_summary(tmp_path):
    """Issues 42 and 54's replay (``tools/live_replay.py``) at smoke size: none, LRU and kvstore fp16 with
    its SSD tier, in fresh processes (each twice: ``--warm``) and in processes whose engine was warmed on
    another trace first, kvstore once more with its page cache dropped; per-request rows, the summary's
    figures for every run, the floor from first-sight tokens, and a store that computes fewer tokens
    than none."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvstore.tools.live_replay", "--model", "tiny", "--trace", "smoke",
                           "--systems", "none", "lru", "kvstore_fp16", "--budgets", "0.5", "--fresh-process", "--warm",
                           "--rounds", "fresh", "warm-engine", "--ssd", "--drop-page-cache", "--out", str(out),
                           "--dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("process for ") == 8 and "| kvstore_fp16 + SSD | 50% |" in proc.stdout
    assert not list((tmp_path / "d").iterdir())  # every store's folder removed after its run
    names = [f"{n}{v}" for n in ("none", "lru-0.5") for v in ("", "@warm-engine")] + [
        f"kvstore_fp16-0.5@{v}" for v in ("ssd", "warm-engine+ssd", "ssd+dropped", "warm-engine+ssd+dropped")]
    runs = {n: json.loads((out / f"replay-{n}.json").read_text()) for n in names}
    n = runs["none"]["trace"]["requests"]
    for name, r in runs.items():
        assert len(r["rows"]) == n and r["prompt_tokens"] == runs["none"]["trace"]["prompt_tokens"]
        assert r["round"] == ("warm-engine" if "warm-engine" in name else "fresh")
        assert r["page_cache_dropped"] == name.endswith("dropped")
        for row in r["rows"]:
            assert row["ttft_s"] >= row["fetch_s"] >= 0 and row["put_s"] >= 0
            assert row["computed_tokens"] == row["prompt_tokens"] - row["cached_tokens"] >= row["first_sight_tokens"]
        if r["round"] == "warm-engine":  # the engine warmed on another trace first, through a cache of its kind
            w = r["warm_up"]
            assert w["cache"] == r["system"] and w["requests"] > 0 and w["seconds"] > 0
            assert w["trace"]["seed"] != r["trace"]["seed"] and w["trace"]["prompt_lengths_shared"] == 0
            assert 0 <= w["measured_shapes_seen"] <= n and "warm_run" not in r
        else:
            assert "warm_up" not in r and len(r["warm_run"]["rows"]) == n
    for r in runs.values():  # each prefill again on its shape, without a cache: the floor's terms
        assert len(r["repeat_prefill_s"]) == n and min(r["repeat_prefill_s"]) > 0
    store = runs["kvstore_fp16-0.5@ssd"]
    assert store["calibrate_s"] > 0 and store["store_stats"]["puts"] == n and store["copy_gbps"] > 0 and store["ssd"]
    assert isinstance(store["ssd_fs"], str)  # (the file system --dir is on: tmpfs would be no disk)
    assert store["budget_bytes"] == int(0.5 * store["unique_kv_bytes"])
    assert store["tokens_computed"] < runs["none"]["tokens_computed"] == runs["none"]["prompt_tokens"]
    assert sum(row["ram_tokens"] + row["ssd_tokens"] for row in store["rows"]) == store["cached_tokens"] > 0
    for row in store["rows"]:  # why each token not served was not (issue 53): they add up to the prompt
        assert row["cached_tokens"] + sum(row["not_served"].values()) == row["prompt_tokens"]
        assert row["not_served"].get("limit") == 1  # (the engine computes the last token itself)
    for name in ("kvstore_fp16-0.5@ssd+dropped", "kvstore_fp16-0.5@warm-engine+ssd+dropped"):  # every request
        drops = runs[name]["page_cache_drops"]
        assert drops["drops"] == n and drops["methods"] == {"fadvise": n}
        assert isinstance(drops["worked"], bool) and 0 <= drops["cached_after_mean"] <= 1
        assert "page_cache_drops" not in runs[name.removesuffix("+dropped")]

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == set(names) and set(summary["engine"]) == {"fresh", "fresh (second round)",
                                                                            "warm-engine"}
    for e in summary["engine"].values():
        assert e["steady_tok_per_s"] > 0
    first_sight = runs["none"]["trace"]["first_sight_tokens"]
    for name, s in summary["runs"].items():
        for key in ("ttft_total_s", "ttft_p50_s", "ttft_p95_s", "ttft_max_s", "put_p50_s", "put_p99_s", "put_max_s",
                    "tokens_computed", "open_s", "calibrate_s", "floor_s", "vs_floor", "vs_cold_max", "new_shape_s",
                    "steady_tok_per_s"):
            assert s[key] is not None, (name, key)
        assert s["first_sight_tokens"] == first_sight <= s["tokens_computed"]
        assert s["vs_floor"] == pytest.approx(s["ttft_total_s"] / s["floor_s"])
        assert s["round"] in ("fresh", "warm-engine") and s["page_cache"] in ("as left", "dropped")
        if s["system"] == "kvstore_fp16":
            lru = summary["runs"]["lru-0.5" + ("@warm-engine" if s["round"] == "warm-engine" else "")]
            assert s["vs_lru"] == pytest.approx(s["ttft_total_s"] / lru["ttft_total_s"])
            for key in ("puts_skipped", "puts_superseded", "blocks_skipped", "fetch_waited_us", "ssd_tokens"):
                assert s[key] >= 0, (name, key)
            assert s["not_served"]["limit"] == n and s["not_served"].get("new", 0) > 0
            assert summary["checks"][f"{name} served + not served = prompt, every request"] is True
            assert f"{name} no fetch waits for the writer" in summary["checks"]
    s = summary["runs"]["kvstore_fp16-0.5@ssd"]
    assert s["warm_vs_lru"] == pytest.approx(s["warm_ttft_total_s"] / summary["runs"]["lru-0.5"]["warm_ttft_total_s"])
    assert summary["runs"]["kvstore_fp16-0.5@warm-engine+ssd+dropped"]["vs_page_cached"] > 0
    assert any(k.startswith("kvstore_fp16-0.5@ssd put p99") for k in summary["checks"])
    assert "page cache dropped before every request" in " ".join(summary["checks"])
    for name, r in runs.items():
        assert r["fetch_total_s"] + r["prefill_total_s"] == pytest.approx(r["ttft_total_s"])
    # `live_replay summary`: one summary of several invocations' folders (here one), the same runs
    merged = subprocess.run([sys.executable, "-m", "kvstore.tools.live_replay", "summary", str(out), "--out",
                             str(tmp_path / "merged")], capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0 and "| kvstore_fp16 + SSD | 50% |" in merged.stdout, merged.stderr[-2000:]
    assert json.loads((tmp_path / "merged" / "summary.json").read_text())["runs"].keys() == summary["runs"].keys()
    # `live_replay compare`: a change's check that every request got the same tokens
    other = tmp_path / "other"
    other.mkdir()
    for name, r in runs.items():
        (other / f"replay-{name}.json").write_text(json.dumps(r))
    compare = [sys.executable, "-m", "kvstore.tools.live_replay", "compare", str(out), str(other)]
    same = subprocess.run(compare, capture_output=True, text=True, timeout=60)
    assert same.returncode == 0 and "every request's tokens identical" in same.stdout, same.stdout
    store["rows"][1]["cached_tokens"] += 1
    (other / "replay-kvstore_fp16-0.5@ssd.json").write_text(json.dumps(store))
    moved = subprocess.run(compare, capture_output=True, text=True, timeout=60)
    assert moved.returncode == 1 and "at requests [1]" in moved.stdout
    assert "kvstore_fp16-0.5@ssd round 1" in moved.stdout


def test_first_sight_tokens_are_what_no_cache_could_have_had():
    """A prompt's first-sight tokens: past the longest prefix an earlier prompt + response began with,
    and at least its last token; over a trace, the prompt tokens less what an unbounded cache serves."""
    import numpy as np

    from kvstore.tools.bench.live_traces import first_sight_tokens, load_trace

    def req(prompt, response):
        return {"prompt": np.array(prompt), "response": np.array(response)}

    trace = {"requests": [req([1, 2, 3], [4]), req([1, 2, 3, 4, 5, 6], [7]), req([1, 2, 9], [1]), req([1, 2, 3], [4]),
                          req([8], [1])]}
    # new; 4 seen (prompt + response); 2 seen; all seen but the last token; new
    assert first_sight_tokens(trace) == [3, 2, 1, 1, 1]
    smoke = load_trace("smoke")
    assert sum(first_sight_tokens(smoke)) == smoke["prompt_tokens"] - smoke["ideal_cached_tokens"]


def test_the_warm_up_trace_shares_no_prompt_length_with_the_measured_one():
    from kvstore.tools.bench.live_traces import SEED, SHIFT_SYSTEM, TRACES, load_trace, warm_up_trace

    for name in ("smoke", "gpu45"):
        measured = load_trace(name)
        trace, settings = warm_up_trace(name, measured)
        assert settings["seed"] != SEED and settings["prompt_lengths_shared"] == 0
        assert settings["sys_lens"] == [n + SHIFT_SYSTEM for n in TRACES[name]["sys_lens"]]
        assert not {len(r["prompt"]) for r in trace["requests"]} & {len(r["prompt"]) for r in measured["requests"]}


def test_the_floor_is_first_sight_at_the_steady_rate_plus_bytes_at_the_bus_plus_a_new_shape_per_request():
    """``live_summary``'s floor from made-up runs: the run's steady rate and the engine's cost of a new
    shape come from its prefills repeated on the same shapes."""
    from kvstore.tools.bench.live_summary import summarize

    def run(system, prefills, computed, repeat):
        rows = [{"ttft_s": t, "fetch_s": 0.0, "prefill_s": t, "prompt_tokens": 100, "cached_tokens": 100 - c,
                 "computed_tokens": c, "first_sight_tokens": f} for t, c, f in zip(prefills, computed, (10, 30))]
        return {"system": system, "budget_frac": 0.0 if system == "none" else 0.25, "round": "warm-engine",
                "rows": rows, "ttft_total_s": sum(prefills), "prefill_total_s": sum(prefills), "prompt_tokens": 200,
                "tokens_computed": sum(computed), "bytes_served": 0, "repeat_prefill_s": repeat, "put_p99_s": 1e-3,
                "put_max_s": 1e-3}

    none = run("none", [1.5, 2.5], [100, 100], [1.0, 1.0])  # 100 tokens/s, 1 s a new shape
    lru = run("lru", [1.2, 1.8], [50, 70], [0.5, 0.7])  # 100 tokens/s, 0.9 s a new shape
    ram, ssd, dropped = (dict(run("kvstore_q8", [t, t], [40, 40], [0.1, 0.1]), ssd=d is not None,
                              page_cache_dropped=bool(d)) for t, d in ((0.5, None), (0.4, False), (0.6, True)))
    got = summarize({"none@warm-engine": none, "lru-0.25@warm-engine": lru, "kvstore_q8-0.25@warm-engine": ram,
                     "kvstore_q8-0.25@warm-engine+ssd": ssd, "kvstore_q8-0.25@warm-engine+ssd+dropped": dropped})
    runs = got["runs"]
    assert runs["kvstore_q8-0.25@warm-engine+ssd"]["vs_ram_only"] == pytest.approx(0.8)
    assert runs["kvstore_q8-0.25@warm-engine+ssd+dropped"]["vs_ram_only"] == pytest.approx(1.2)
    assert runs["kvstore_q8-0.25@warm-engine+ssd+dropped"]["vs_page_cached"] == pytest.approx(1.5)
    assert got["checks"]["kvstore_q8-0.25@warm-engine+ssd+dropped vs RAM only <= 1.0"] is False
    assert runs["kvstore_q8-0.25@warm-engine+ssd"]["vs_lru"] == pytest.approx(0.8 / 3.0)
    assert got["engine"]["warm-engine"] == {"steady_tok_per_s": 100.0, "new_shape_s": 1.0,
                                            "from": "its prefills repeated"}
    s = got["runs"]["lru-0.25@warm-engine"]
    assert s["first_sight_tokens"] == 40 and s["steady_tok_per_s"] == pytest.approx(100.0)
    assert s["new_shape_s"] == pytest.approx(0.9) and s["floor_s"] == pytest.approx(40 / 100 + 2 * 0.9)
    assert s["vs_floor"] == pytest.approx(3.0 / 2.2)
    assert got["checks"]["lru-0.25@warm-engine computes at least its first-sight tokens, every request"] is True


def test_a_page_cache_drop_takes_a_mapped_lmdb_file_out_of_the_page_cache(tmp_path):
    """``page_cache.drop`` on an LMDB file read through its map (which fadvise alone leaves cached): the
    file's pages out of the page cache, measured."""
    import os

    import lmdb

    from kvstore.tools.bench import page_cache

    env = lmdb.open(str(tmp_path), map_size=64 << 20, writemap=True)
    with env.begin(write=True) as txn:
        for i in range(16):
            txn.put(b"%d" % i, os.urandom(1 << 20))
    env.sync(True)
    with env.begin() as txn:
        assert sum(len(txn.get(b"%d" % i)) for i in range(16)) == 16 << 20
    got = page_cache.drop(tmp_path)
    env.close()
    assert got["method"] == "fadvise" and got["bytes"] == 64 << 20
    if got["cached_before"] is not None:  # (mincore or cachestat: Linux)
        assert got["cached_before"] >= 0.2 and got["clean_after"] <= page_cache.WORKED
    assert page_cache.drop(tmp_path / "none")["method"] == "none"


def test_live_replay_serve_replays_sessions_in_order_through_both_servers(tmp_path):
    """The server variant: mlx_lm.server and ``kvstore serve``, each a process, 2 clients; a session's
    turns never overlap, nothing fails, and the store serves cached tokens."""
    proc = subprocess.run([sys.executable, "-m", "kvstore.tools.live_replay", "serve", "--model", "tiny", "--trace",
                           "smoke", "--clients", "2", "--max-tokens", "4", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "serve.json").read_text())
    assert set(res["servers"]) == {"mlx_lm_server", "kvstore_serve"} and res["kvstore_vs_mlx_lm"] > 0
    for s in res["servers"].values():
        assert s["errors"] == 0 and len(s["rows"]) == res["trace"]["requests"]
        by_session: dict = {}
        for row in s["rows"]:
            assert row["ttft_s"] > 0 and row["prompt_tokens"] > 0
            by_session.setdefault(row["session"], []).append(row)
        for turns in by_session.values():  # trace order within a session, one at a time
            assert all(a["end_s"] <= b["start_s"] for a, b in zip(turns, turns[1:]))
    assert res["servers"]["kvstore_serve"]["cached_tokens"] > 0


def test_fetch_path_traces_a_ram_hit_and_a_disk_hit_and_reports_its_figures(tmp_path):
    """``kvstore bench fetch-path`` (issue 52's figures) at a small size: both fetches traced, every figure in
    its place and consistent with the others (the limits are the fetch pipeline's tests', not this one's)."""
    proc = subprocess.run([sys.executable, "-m", "kvstore.tools.bench", "fetch-path", "--tokens", "512", "--layers",
                           "2", "--warmup", "1", "--json", "--out", str(tmp_path / "fp.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got == json.loads((tmp_path / "fp.json").read_text())
    assert got["setup"]["tokens"] == 512 and got["setup"]["layers"] == 2
    for name, source in (("ram_hit", "ram_tokens"), ("disk_hit", "ssd_tokens")):
        rep = got[name]
        assert rep["hit"]["length"] == rep["hit"][source] == 512, (name, rep["hit"])
        assert rep["modules"] == sorted(set(rep["modules"])) and rep["module_count"] == len(rep["modules"])
        assert "kvstore.store" in rep["modules"]
        assert all(m.startswith("kvstore.") and not m.startswith(("kvstore.adapters", "kvstore.tools"))
                   for m in rep["modules"])
        assert isinstance(rep["transitions"], int) and rep["transitions"] >= rep["module_count"] - 1
        assert rep["lock_acquisitions"] == sum(rep["locks_by_caller"].values()) == sum(rep["locks_by_kind"].values())
        assert all(site.split(":")[0] in rep["modules"] for site in rep["locks_by_caller"])
    assert "kvstore.tiers.disk.lmdb" in got["disk_hit"]["modules"]
    assert "kvstore.tiers.disk.lmdb" not in got["ram_hit"]["modules"]


def test_one_fetch_takes_at_most_eight_of_the_stores_locks():
    """Issue 52: a fetch is one pass, so a RAM hit and a disk hit each take at most 8 acquisitions of the
    package's own locks on the engine's thread (before the fetch pipeline: 36, the table's eight times, the
    counters' eight, a thread-pool lookup per layer and tensor). Counted, not timed: the same on any box."""
    proc = subprocess.run([sys.executable, "-m", "kvstore.tools.bench", "fetch-path", "--tokens", "1024", "--layers",
                           "4", "--warmup", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    for name in ("ram_hit", "disk_hit"):
        assert got[name]["lock_acquisitions"] <= 8, (name, got[name]["locks_by_caller"])


def test_fetch_path_counts_each_lock_taken_by_the_store_once():
    """The tracer's lock rule on a real lock: a ``with`` on a C lock (whose enter raises no profile event),
    an explicit acquire, and a lock the standard library takes on the store's behalf (not counted)."""
    import threading

    from kvstore.counters import Counters
    from kvstore.tools.bench.fetch_path import trace

    c = Counters()
    done = threading.Event()
    done.set()

    def three_counts():
        for _ in range(3):
            c.count("hits")
        done.wait()  # called from here, not from the store: not the package's

    _, rep = trace(three_counts)
    assert rep["locks_by_caller"] == {"kvstore.counters:Counters.count": 3} and rep["lock_acquisitions"] == 3
    assert rep["modules"] == ["kvstore.counters"] and rep["transitions"] == 0
    assert c.snapshot()["hits"] == 3
