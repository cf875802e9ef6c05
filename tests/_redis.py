"""Real Redis servers for the remote-tier tests: each on a free loopback port,
in its own temporary directory, with a password, no persistence, and the
eviction settings docs/remote.md recommends; with ``tls=True``, TLS only, under a
self-signed certificate for 127.0.0.1 made by ``openssl``. Tests skip only when
``redis-server`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

PASSWORD = "kv-test-secret"
SERVER = shutil.which("redis-server")
CLI = shutil.which("redis-cli")
OPENSSL = shutil.which("openssl")


def need_redis() -> None:
    if SERVER is None or CLI is None:
        pytest.skip("redis-server / redis-cli not installed (.ci/run installs Debian's redis-server)")
    pytest.importorskip("redis", reason="the remote extra is not installed: pip install -e '.[test]'")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(bus: bool = False) -> int:
    """A free port (and its cluster bus port, +10000, when ``bus``)."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _free(port) and (not bus or _free(port + 10000)):
            return port
    raise RuntimeError("no free port")


class RedisServer:
    def __init__(self, workdir: Path, port: Optional[int] = None, cluster: bool = False,
                 password: str = PASSWORD, tls: bool = False):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(bus=cluster)
        self.cluster = cluster
        self.password = password
        self.tls = tls
        self.cert = self.dir / "cert.pem"  # with tls: the server's certificate, its own CA
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://:{self.password}@127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--requirepass", self.password, "--save", "", "--appendonly", "no",
                "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", "--logfile", "redis.log"]
        if self.tls:
            subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                            "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout",
                            str(self.dir / "key.pem"), "-out", str(self.cert)], check=True, capture_output=True)
            args[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                         "--tls-key-file", str(self.dir / "key.pem"), "--tls-ca-cert-file", str(self.cert),
                         "--tls-auth-clients", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--masterauth", self.password, "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_up()
        return self

    def wait_up(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            if self.cli("ping").strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def cli(self, *args: str) -> str:
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        tls = ["--tls", "--cacert", str(self.cert)] if self.tls else []
        r = subprocess.run([CLI, "-p", str(self.port), *tls, *args], capture_output=True, text=True, env=env,
                           timeout=30)
        return r.stdout

    def client(self):
        import redis

        tls = dict(ssl=True, ssl_ca_certs=str(self.cert)) if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **tls)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot die otherwise
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def start_cluster(workdir: Path, masters: int = 3) -> list[RedisServer]:
    nodes = [RedisServer(workdir / f"node{i}", cluster=True).start() for i in range(masters)]
    env = dict(os.environ, REDISCLI_AUTH=PASSWORD)
    subprocess.run([CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                    "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, env=env, timeout=60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            return nodes
        time.sleep(0.1)
    raise RuntimeError("the cluster did not come up")
