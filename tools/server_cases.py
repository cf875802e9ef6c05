"""Cached prompt tokens of the requests mlx-lm's server caches, on ``kvstore serve``.

Starts ``kvstore serve`` (a subprocess, on loopback) with tiny models and
sends each case's chats, printing what every response reports as
``usage.prompt_tokens_details.cached_tokens``:

- image: a prompt with an image (tiny VLM; mlx-lm keys its patch tokens by a
  negative 64-bit id), its follow-up, a text-only prompt sharing the system
  prompt, and the image prompt again;
- speculative: ``--draft-model``; two prompts sharing a long system prompt,
  then the first again (its answer must be the cold one);
- options: ``--prompt-cache-size`` (refused, or what a request then caches)
  and ``--prompt-cache-bytes`` on a RAM-only store (what the second of two
  prompts sharing a system prompt finds within that budget).

``--python`` runs the server with another interpreter, e.g. another
checkout's virtualenv, to compare two versions of kvstore on the same cases.

    python tools/server_cases.py [--python /path/to/other/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from kvstore.adapters.tiny_models import make_tiny_model
from kvstore.adapters.tiny_vlm import make_tiny_vlm

SYSTEM = "You are a helpful assistant who answers briefly. " * 25


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, python: str, log: Path, *argv):
        self.port = _port()
        self.log = log
        cmd = [python, "-m", "kvstore.adapters.cli", "serve", *map(str, argv), "--block-size", "64",
               "--host", "127.0.0.1", "--port", str(self.port)]
        # run from the log's folder: `python -m` puts the working directory first on sys.path, and a
        # checkout's own kvstore/ there would shadow the one the interpreter has installed
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=log.parent)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("kvstore serve did not start")

    def chat(self, messages, max_tokens=8) -> dict:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        return {"prompt": out["usage"]["prompt_tokens"], "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
                "text": out["choices"][0]["message"]["content"]}

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        return self.log.read_text(errors="replace")


def _image(seed: int) -> dict:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def _system(*turns):
    return [{"role": "system", "content": SYSTEM}, *turns]


def _row(name: str, r: dict) -> str:
    return f"  {name:<44} {r['cached']:>5} of {r['prompt']:>4} prompt tokens cached"


def image_case(python: str, models: dict, tmp: Path) -> list[str]:
    picture = [{"type": "text", "text": "What is in this picture?"}, _image(1)]
    s = Serve(python, tmp / "image.log", "--model", models["vlm"], "--trust-remote-code")
    try:
        first = s.chat(_system({"role": "user", "content": picture}))
        follow = s.chat(_system({"role": "user", "content": picture}, {"role": "assistant", "content": first["text"]},
                                {"role": "user", "content": "And what colours does it have?"}))
        text = s.chat(_system({"role": "user", "content": "What is in this text?"}))
        again = s.chat(_system({"role": "user", "content": picture}))
    finally:
        log = s.stop()
    errors = log.count("ERROR")
    return ["image prompts:", _row("image prompt (cold)", first), _row("its follow-up", follow),
            _row("text-only prompt sharing the system prompt", text), _row("the image prompt again", again),
            f"  errors logged by the server: {errors}"]


def speculative_case(python: str, models: dict, tmp: Path) -> list[str]:
    s = Serve(python, tmp / "spec.log", "--model", models["main"], "--draft-model", models["draft"],
              "--num-draft-tokens", "3")
    try:
        first = s.chat(_system({"role": "user", "content": "hello there"}), 16)
        second = s.chat(_system({"role": "user", "content": "how are you today"}), 16)
        repeat = s.chat(_system({"role": "user", "content": "hello there"}), 16)
    finally:
        s.stop()
    return ["speculative decoding (--draft-model):", _row("first prompt (cold)", first),
            _row("second prompt, same system prompt", second) + f" ({100 * second['cached'] / second['prompt']:.0f}%)",
            _row("first prompt again", repeat) + f"; answer {'equals' if repeat['text'] == first['text'] else 'DIFFERS FROM'} the cold one"]


def options_case(python: str, models: dict, tmp: Path) -> list[str]:
    out = ["mlx-lm cache options:"]
    s = Serve(python, tmp / "size.log", "--model", models["main"], "--prompt-cache-size", "5")
    try:
        if s.proc.poll() is None:
            r = s.chat(_system({"role": "user", "content": "hello there"}))
            out.append(f"  --prompt-cache-size 5: accepted (no effect on the store); request cached {r['cached']}")
    finally:
        log = s.stop()
    if s.proc.returncode == 2:
        out.append("  --prompt-cache-size 5: refused: " + log.strip().splitlines()[-1])
    s = Serve(python, tmp / "bytes.log", "--model", models["main"], "--prompt-cache-bytes", "0.2M")
    try:
        for q in ("hello there", "how are you today"):
            r = s.chat(_system({"role": "user", "content": q}))
    finally:
        s.stop()
    # RAM only: a 0.2 MB budget holds ~390 tokens of the tiny llama's KV (516 bytes a token)
    out.append(f"  --prompt-cache-bytes 0.2M (no --ssd-path): second request cached {r['cached']} of {r['prompt']}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs `kvstore serve`")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {"vlm": str(make_tiny_vlm(tmp / "vlm")), "main": str(make_tiny_model("llama", tmp / "main")),
                  "draft": str(make_tiny_model("llama", tmp / "draft", seed=1, num_hidden_layers=1))}
        for case in (image_case, speculative_case, options_case):
            print("\n".join(case(args.python, models, tmp)), flush=True)


if __name__ == "__main__":
    main()
