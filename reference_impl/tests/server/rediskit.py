"""Real redis-server processes on loopback with random ports, for the Redis L2 tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

REDIS_BIN = shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """One redis-server without persistence; `kill` and `start` again reuse the same port (a restart)."""

    def __init__(self, maxmemory: str = "0", policy: str = "allkeys-lru", password: str = "",
                 certs: str = "", extra: tuple[str, ...] = ()) -> None:
        """`certs`: a folder from make_certs(): TLS only (on our port), and clients must show a certificate.
        `extra`: more redis-server arguments (an ACL `--user` line)."""
        assert REDIS_BIN is not None
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="hkv-redis-")
        self.maxmemory, self.policy, self.password, self.certs, self.extra = maxmemory, policy, password, certs, extra
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.certs else 'redis'}://127.0.0.1:{self.port}/0"

    def _tls(self) -> dict:
        c = self.certs
        return {"ssl": True, "ssl_ca_certs": f"{c}/ca.crt", "ssl_certfile": f"{c}/client.crt",
                "ssl_keyfile": f"{c}/client.key"} if c else {}

    def start(self) -> None:
        """Start (or restart) the server on our port and wait until it answers PING."""
        import redis

        self.proc = subprocess.Popen(
            [REDIS_BIN, *(["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", f"{self.certs}/server.crt",
                           "--tls-key-file", f"{self.certs}/server.key", "--tls-ca-cert-file", f"{self.certs}/ca.crt",
                           "--tls-auth-clients", "yes"] if self.certs else ["--port", str(self.port)]),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
             "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
             *(["--requirepass", self.password] if self.password else []), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5,
                             password=self.password or None, **self._tls())
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start "
                                       f"(exit {self.proc.poll()})") from None
                time.sleep(0.02)
        client.close()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=self.password or None,
                           **self._tls())

    def kill(self) -> None:
        """SIGKILL the server: every key is gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def make_certs(folder: str) -> str:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it (openssl); keys 0600."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=hybridkv test CA")
    with open(f"{folder}/san", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
            "-subj", f"/CN=hybridkv test {who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{who}.crt", "-days", "2", "-extfile", "san")
    for key in ("ca.key", "server.key", "client.key"):
        os.chmod(f"{folder}/{key}", 0o600)
    return folder


def skip_reason() -> str | None:
    """Why the Redis tests cannot run here, or None when they can."""
    if REDIS_BIN is None:
        return "redis-server (or valkey-server) is not installed: apt-get install -y redis-server"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client is not installed: pip install -e '.[redis]'"
    return None
