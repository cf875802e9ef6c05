"""`kvstore serve` is mlx-lm's server on the store: a real process on loopback."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvstore.adapters.tiny_models import make_tiny_model

SYSTEM = "You are a helpful assistant who answers briefly. " * 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, store, port, log, *extra, env=None):
    return launch([sys.executable, "-m", "kvstore.adapters.cli", "serve", "--model", str(model), "--ssd-path",
                   str(store), "--budget-gb", "1", "--block-size", "64", "--host", "127.0.0.1", "--port", str(port),
                   *extra], port, log, env)


def launch(cmd, port, log, env=None):
    """A server process, once it listens on ``port``."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail("server did not start")


def chat(port, question, full=False, **fields):
    """A chat request's usage (``full``: the whole response)."""
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, **fields}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    return out if full else out["usage"]


def stop(proc):
    proc.send_signal(signal.SIGTERM)  # must flush the store, not die mid-write
    assert proc.wait(timeout=60) == 0


def test_serve_reports_cached_tokens_and_keeps_them_across_restart(tmp_path):
    """Restarted with another --block-size, the server serves the store in the
    block size it was written with and says so; its log shows the model's
    calibration (issue 41: a silent first request, a silent miss)."""
    model = make_tiny_model("llama", tmp_path / "model")
    store = tmp_path / "store"
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = start(model, store, port, log)
        try:
            first = chat(port, "hello there")
            second = chat(port, "how are you today")
        finally:
            stop(proc)
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        # the shared system prompt (a few hundred tokens) came from the store
        assert second["prompt_tokens_details"]["cached_tokens"] > 0.8 * first["prompt_tokens"]

        proc = start(model, store, port, log, "--block-size", "256")
        try:
            third = chat(port, "what is new")
        finally:
            stop(proc)
    assert third["prompt_tokens_details"]["cached_tokens"] > 0.8 * first["prompt_tokens"]
    text = (tmp_path / "server.log").read_text()
    assert text.count("holds blocks of 64 tokens: block_size=256 is not used") == 1
    assert "timing prefills of model" in text and "kvstore: timed " in text


def serve_once(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.adapters.cli", "serve", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_serve_with_a_missing_model_exits_at_start_in_one_line_and_creates_nothing(tmp_path):
    """It stayed up after mlx-lm's generation thread died and answered every
    request 404 "generation thread died"."""
    res = serve_once("--model", tmp_path / "nonexistent", "--ssd-path", tmp_path / "store", "--port", free_port())
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot load the model" in lines[0] and "no such file or folder" in lines[0], lines
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("flag, says", [(["--store-kv-bits", "7"], "kv_bits"), (["--budget-gb", "-2"], "budget_gb"),
                                        (["--block-size", "0"], "block_size")])
def test_a_bad_store_option_is_one_line_before_the_model_loads(tmp_path, flag, says):
    res = serve_once("--model", tmp_path / "nonexistent", "--ssd-path", tmp_path / "store", *flag)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines  # (not the model's error)
    assert not (tmp_path / "store").exists()


def test_models_endpoint_answers_without_a_hugging_face_cache(tmp_path):
    """mlx-lm's GET /v1/models scans the Hugging Face cache: without one it
    failed half-way with a CacheNotFound traceback in the log."""
    model = make_tiny_model("llama", tmp_path / "model")
    port = free_port()
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "no-hf-cache"))
    with open(tmp_path / "server.log", "wb") as log:
        proc = start(model, tmp_path / "store", port, log, env=env)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
                listed = json.load(r)
        finally:
            stop(proc)
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [str(model.resolve())]
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def scrape(port) -> dict:
    """``GET /metrics``, parsed: {(name, its label's value: tier, reason or le): value} of the ``kvstore_``
    samples."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        text = r.read().decode()
    return {(s.name, next(iter(s.labels.values()), None)): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("kvstore_")}


def test_metrics_endpoint_counts_what_the_server_serves(tmp_path):
    """Issue 44: GET /metrics on the server's own port, Prometheus text, the
    store's kvstore_* series moving as requests are served; other paths unchanged."""
    model = make_tiny_model("llama", tmp_path / "model")
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = start(model, tmp_path / "store", port, log)
        try:
            before = scrape(port)
            chat(port, "hello there")
            second = chat(port, "hello there")
            after = scrape(port)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
                health = json.load(r)
        finally:
            stop(proc)
    assert health == {"status": "ok"}
    assert len(after) >= 20 and all(isinstance(v, float) for v in after.values())
    grew = {k for k in after if after[k] > before.get(k, 0)}
    assert {("kvstore_requests_total", None), ("kvstore_hits_total", None), ("kvstore_misses_total", None),
            ("kvstore_tokens_requested_total", None), ("kvstore_puts_total", None),
            ("kvstore_blocks_stored_total", None), ("kvstore_bytes", "ram"), ("kvstore_blocks", "ram")} <= grew, grew
    served = sum(after[("kvstore_tokens_served_total", t)] for t in ("ram", "ssd"))
    assert served == second["prompt_tokens_details"]["cached_tokens"] > 0
    assert after[("kvstore_hits_total", None)] + after[("kvstore_misses_total", None)] == \
        after[("kvstore_requests_total", None)]


REQUEST_LINE = re.compile(r"kvstore: request ([\d,]+) tokens: served ([\d,]+)(?: \((.*?)\))?; "
                          r"not served ([\d,]+)(?: \((.*?)\))?$", re.M)


def counts(text: str) -> dict:
    """``ram 3,840, ssd 64`` as {"ram": 3840, "ssd": 64}."""
    return {k: int(v.replace(",", "")) for k, v in (p.rsplit(" ", 1) for p in text.split(", "))} if text else {}


def test_why_tokens_were_not_served_in_metrics_and_the_debug_log(tmp_path):
    """Issue 53 through the server: every prompt token requested is served by a tier or not served for a
    reason (/metrics, summed, and each request's debug line); the latency histograms count each fetch and
    put; ``--log-level debug`` (lower case, as operators type it) turns the line on."""
    from kvstore.flow.reasons import REASONS

    model = make_tiny_model("llama", tmp_path / "model")
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = start(model, tmp_path / "store", port, log, "--log-level", "debug")
        try:
            first = chat(port, "hello there")
            second = chat(port, "how are you today")
            m = scrape(port)
        finally:
            stop(proc)
    why = {w: m[("kvstore_tokens_not_served_total", w)] for w in REASONS}
    served = sum(m.get(("kvstore_tokens_served_total", t), 0) for t in ("device", "ram", "ssd", "remote"))
    assert served + sum(why.values()) == m[("kvstore_tokens_requested_total", None)]
    assert served == second["prompt_tokens_details"]["cached_tokens"] > 0
    assert why["new"] > 0 and why["limit"] == 2  # the first prompt new; each request's last token the engine's
    fetches = m[("kvstore_requests_total", None)]
    assert m[("kvstore_fetch_seconds_count", None)] == m[("kvstore_fetch_seconds_bucket", "+Inf")] == fetches >= 2
    assert m[("kvstore_put_seconds_count", None)] == m[("kvstore_puts_total", None)] >= 2

    lines = REQUEST_LINE.findall((tmp_path / "server.log").read_text())
    assert len(lines) == fetches, lines
    for (tokens, got, tiers, missed, reasons), usage in zip(lines, (first, second)):
        tokens, got, missed = (int(x.replace(",", "")) for x in (tokens, got, missed))
        assert tokens == usage["prompt_tokens"] and got == usage["prompt_tokens_details"]["cached_tokens"]
        assert got + missed == tokens and sum(counts(tiers).values()) == got
        assert sum(counts(reasons).values()) == missed and counts(reasons).get("limit") == 1
