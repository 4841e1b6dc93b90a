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
                 certs: str = "", extra: tuple[str, ...] = (), port: int = 0) -> None:
        """`certs`: a folder from make_certs(): TLS only (on our port), and clients must show a certificate.
        `extra`: more redis-server arguments (an ACL `--user` line). `port`: 0 for one the kernel picks."""
        assert REDIS_BIN is not None
        self.port = port or free_port()
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


def key_of(i: int) -> bytes:
    """Object key number `i`: 16 bytes."""
    return i.to_bytes(4, "little") * 4


def payload(i: int, size: int) -> bytes:
    """Object `i`'s `size` bytes, the same every time."""
    import random

    block = random.Random(i).randbytes(4096)
    return (block * (size // 4096 + 1))[:size]


def read_back(l2, key: bytes, group: int) -> bytes | None:
    """What the adapter serves for (key, group), or None for a miss."""
    n = l2.length(key, group)
    if n is None:
        return None
    out = bytearray(n)
    return bytes(out) if l2.get_into(key, group, memoryview(out)) else None


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


def free_cluster_port() -> int:
    """A free port P whose cluster bus port (P + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisCluster:
    """A cluster of `n` primaries (no replicas) on loopback, made with `redis-cli --cluster create`.

    `cluster-require-full-coverage no`, as a cache's cluster should run: with a primary gone the others keep
    serving their slots. `password`: requirepass and masterauth on every node."""

    def __init__(self, n: int = 3, password: str = "", node_timeout_ms: int = 1000, certs: str = "",
                 replicas: int = 0) -> None:
        """`certs`: a folder from make_certs(): TLS only, between the nodes too (tls-cluster). `replicas`: per
        primary (n / (replicas + 1) primaries)."""
        extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
                 str(node_timeout_ms), "--cluster-require-full-coverage", "no",
                 *(("--masterauth", password) if password else ()), *(("--tls-cluster", "yes") if certs else ()))
        self.password, self.certs = password, certs
        self.nodes: list[RedisProcess] = []
        try:
            for _ in range(n):
                self.nodes.append(RedisProcess(password=password, extra=extra, port=free_cluster_port(), certs=certs))
            subprocess.run([self.cli_bin(), *self._auth(), "--cluster", "create",
                            *(f"127.0.0.1:{r.port}" for r in self.nodes), "--cluster-replicas", str(replicas),
                            "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def cli_bin() -> str:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        assert cli is not None
        return cli

    def _auth(self) -> list[str]:
        c = self.certs
        return [*(["-a", self.password, "--no-auth-warning"] if self.password else []),
                *(["--tls", "--cacert", f"{c}/ca.crt", "--cert", f"{c}/client.crt", "--key", f"{c}/client.key"]
                  if c else [])]

    @property
    def url(self) -> str:
        """The adapter's url: every node a seed."""
        return f"{'rediss' if self.certs else 'redis'}+cluster://" + ",".join(f"127.0.0.1:{r.port}" for r in self.nodes)

    def cli(self, *args: str, timeout: float = 120) -> str:
        """redis-cli's output for `args` (e.g. "--cluster", "reshard", ...), failing the test when it fails."""
        p = subprocess.run([self.cli_bin(), *self._auth(), *args], capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"redis-cli {' '.join(args)} failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr}"
        return p.stdout

    def wait_agree(self, timeout: float = 20) -> None:
        """Until `redis-cli --cluster check` finds every node agreeing on the slots (after a SETSLOT by hand the
        nodes' gossip takes a moment; a resharding refuses to start before)."""
        deadline = time.monotonic() + timeout
        while True:
            p = subprocess.run([self.cli_bin(), *self._auth(), "--cluster", "check", f"127.0.0.1:{self.nodes[0].port}"],
                               capture_output=True, text=True, timeout=60)
            if p.returncode == 0 and "[ERR]" not in p.stdout and "[WARNING]" not in p.stdout:
                return
            assert time.monotonic() < deadline, f"the nodes do not agree: {p.stdout[-2000:]}"
            time.sleep(0.1)

    def wait_ok(self, alive: list[RedisProcess] | None = None, timeout: float = 20) -> None:
        """Until every live node says cluster_state:ok and knows all slots' owners."""
        deadline = time.monotonic() + timeout
        for r in alive or self.nodes:
            c = r.client()
            while True:
                info = c.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" in text:
                    break
                assert time.monotonic() < deadline, f"cluster not ok on port {r.port}: {text[:200]}"
                time.sleep(0.05)
            c.close()

    def wait_down(self, nodes: list[RedisProcess], timeout: float = 20) -> None:
        """Until each of `nodes` says cluster_state:fail."""
        deadline = time.monotonic() + timeout
        for r in nodes:
            while "cluster_state:fail" not in str(r.client().execute_command("CLUSTER", "INFO")):
                assert time.monotonic() < deadline, f"cluster still up on port {r.port}"
                time.sleep(0.05)

    def primaries(self) -> list[RedisProcess]:
        ports = {int(p[1]) for _, _, p, *_ in self.nodes[0].client().execute_command("CLUSTER", "SLOTS")}
        return [r for r in self.nodes if r.port in ports]

    def node_id(self, r: RedisProcess) -> str:
        out = r.client().execute_command("CLUSTER", "MYID")
        return out.decode() if isinstance(out, bytes) else str(out)

    def owner(self, slot: int) -> RedisProcess:
        """The node that serves `slot` (as the first node's map says)."""
        for start, end, primary, *_ in self.nodes[0].client().execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(r for r in self.nodes if r.port == int(primary[1]))
        raise AssertionError(f"slot {slot} has no owner")

    def close(self) -> None:
        for r in self.nodes:
            r.close()


def started_cluster() -> RedisCluster:
    """A 3-node cluster on loopback for a test fixture (it closes it), or the test skipped, saying why."""
    import pytest

    if (why := cluster_skip_reason()) is not None:
        pytest.skip(why)
    return RedisCluster()


def cluster_skip_reason() -> str | None:
    """Why the Redis Cluster tests cannot run here, or None when they can."""
    return skip_reason() or (None if shutil.which("redis-cli") or shutil.which("valkey-cli") else
                             "redis-cli (or valkey-cli) is not installed: apt-get install -y redis-tools")
