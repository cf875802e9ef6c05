"""A server process under test or benchmark: a free loopback port, and a wait
until it answers."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_answering(url: str, proc: subprocess.Popen, timeout: float, what: str = "the server") -> None:
    """Until ``url`` answers; ``RuntimeError`` if ``proc`` exits first,
    ``TimeoutError`` after ``timeout`` seconds (``proc`` is then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{what} did not answer {url} in {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (a server flushes and exits), then SIGKILL after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
