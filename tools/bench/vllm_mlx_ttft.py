"""TTFT through vllm-mlx's own OpenAI server: its built-in prefix cache against
``kvstore vllm-mlx serve``, a cold request, the same request again, and the
same request after the server was killed (SIGKILL) and started again.

    kvstore bench vllm-mlx-ttft [--layers 6] [--trials 3] [--out DIR]

Needs vllm-mlx (CI's second virtualenv has it). Each trial sends one chat
request of ~1,500 tokens (its own system prompt, so each cold request is cold)
with the OpenAI streaming API, temperature 0, and times the first content
chunk. Servers run continuous batching on a fixed-seed tiny llama (fp32, CPU).
Reported: medians over trials and each hit's ratio to the cold request of the
same run. The must-hold is hit TTFT <= 0.3x cold, repeated and after SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvstore.adapters.tiny_models import make_tiny_model
from kvstore.tools.servers import free_port, wait_answering

SYSTEM = "You are a helpful assistant who answers briefly and exactly. Keep every answer short. "


class Server:
    """One ``vllm-mlx serve`` or ``kvstore vllm-mlx serve`` process (``cmd``
    up to its options; host and port are added), logging to ``log``."""

    def __init__(self, cmd: list[str], log: Path):
        self.port = free_port()
        self.model = cmd[cmd.index("serve") + 1]
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_answering(f"http://127.0.0.1:{self.port}/v1/models", self.proc, 300, f"the server (log: {log})")

    def ttft(self, trial: int, repeat_system: int) -> float:
        """Seconds to the first streamed content chunk of trial ``trial``'s request."""
        system = f"Session {trial}. " + SYSTEM * repeat_system
        body = {"model": self.model, "max_tokens": 4, "temperature": 0, "stream": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is 2+2?"}]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        first = None
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:  # read to the end: a client that hangs up aborts the request, and nothing is cached
                line = line.decode().strip()
                if first is not None or not line.startswith("data:") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[5:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError("the response streamed no content")
        return first

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self) -> int:
        """SIGTERM: a clean shutdown; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.log.close()


def measure(name: str, cmd: list[str], work: Path, trials: int, repeat_system: int) -> dict:
    log = work / f"{name}.log"
    server = Server(cmd, log)
    cold, again = [], []
    try:
        for t in range(trials):
            cold.append(server.ttft(t, repeat_system))
            again.append(server.ttft(t, repeat_system))
    finally:
        server.kill()
    server = Server(cmd, log)
    try:
        restarted = [server.ttft(t, repeat_system) for t in range(trials)]
    finally:
        server.stop()
    med = statistics.median
    out = {"cold_s": cold, "repeat_s": again, "after_sigkill_s": restarted,
           "cold_median_s": med(cold), "repeat_median_s": med(again), "after_sigkill_median_s": med(restarted),
           "repeat_ratio": med(a / c for a, c in zip(again, cold)),
           "after_sigkill_ratio": med(r / c for r, c in zip(restarted, cold))}
    print(f"{name:>10}: cold {out['cold_median_s'] * 1e3:7.0f} ms  repeat {out['repeat_median_s'] * 1e3:7.0f} ms "
          f"({out['repeat_ratio']:.2f}x)  after SIGKILL {out['after_sigkill_median_s'] * 1e3:7.0f} ms "
          f"({out['after_sigkill_ratio']:.2f}x)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvstore bench vllm-mlx-ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6, help="layers of the tiny fp32 llama")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--repeat-system", type=int, default=38, help="system prompt repeats (38: ~1,520 tokens)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvstore-vllm-ttft-"))
    try:
        model = make_tiny_model("llama", work / "model", num_hidden_layers=args.layers, dtype="float32")
        vllm_mlx = str(Path(sys.executable).with_name("vllm-mlx"))
        kvstore = [sys.executable, "-m", "kvstore.adapters.cli", "vllm-mlx", "serve", str(model),
                   "--ssd-path", str(work / "store")]
        results = {
            "config": {"model": f"tiny llama, {args.layers} layers, fp32", "trials": args.trials,
                       "repeat_system": args.repeat_system, "python": sys.version.split()[0]},
            # vllm-mlx's own cache, persisted the way it persists (save at a clean shutdown, load at start)
            "vllm-mlx": measure("vllm-mlx", [vllm_mlx, "serve", str(model), "--continuous-batching"], work,
                                args.trials, args.repeat_system),
            "kvstore": measure("kvstore", kvstore, work, args.trials, args.repeat_system),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm-mlx-ttft.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out / 'vllm-mlx-ttft.json'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
