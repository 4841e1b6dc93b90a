"""How many clients a server takes at once, on real server processes: more connections than its open-file
limit, and tcp connections past the cap, leave it serving without spinning."""

from __future__ import annotations

import resource
import socket
import time

import pytest
from hybridkv.engine.client import CacheClient
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from serverkit import process_cpu_s, process_fds


def hold_connections(path: str, n: int) -> list[socket.socket]:
    """n bare unix-socket connections to an ipc endpoint that never speak (each costs the server one fd)."""
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:  # refused while the server is at its cap: what an attacker sees
            s.close()
            continue
        held.append(s)
    return held


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("soft_only", [True, False])
def test_more_connections_than_the_fd_limit_leave_the_server_serving(sock_dir, soft_only):
    """libzmq aborts on EMFILE on an ipc endpoint (and spins on tcp). The server raises its soft limit to the
    hard one at start, and past its cap on clients stops accepting until connections close."""
    endpoint = f"ipc://{sock_dir}/fd.sock"
    if soft_only:  # the common default: a soft limit far below the hard one
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        old = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        try:
            s = start_server(ServerConfig(endpoint=endpoint, l1_bytes=int(0.02 * GIB), admin=True))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, old)
    else:
        s = start_server(ServerConfig(endpoint=endpoint, l1_bytes=int(0.02 * GIB), admin=True), nofile=256)
    try:
        with CacheClient(endpoint, timeout_s=10) as early:
            assert early.call(P.Health())[0].status == "ok"
            held = hold_connections(endpoint[len("ipc://"):], 400)
            try:
                time.sleep(0.5)
                assert s.alive(), s.proc.stderr.read() if s.proc.stderr else ""
                assert early.call(P.Health())[0].status == "ok"  # a connected client keeps being served
            finally:
                for h in held:
                    h.close()
            with CacheClient(endpoint, timeout_s=10) as late:  # and new ones get in once others left
                assert late.call(P.Health(), timeout=10)[0].status == "ok"
        assert s.alive()
    finally:
        s.close()


def test_tcp_connections_past_the_cap_are_refused_without_spinning(sock_dir):
    """A tcp endpoint had no cap: libzmq accepted until the open-file limit, then spun on EMFILE at 100% of a
    core while the connections stayed, and no new engine got in. Now the door closes at --max-clients (the
    kernel drops new SYNs), the server idles, connected clients are served, and new ones get in once others
    left."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    port = int(endpoint.rsplit(":", 1)[1])
    s = start_server(ServerConfig(endpoint=endpoint, l1_bytes=int(0.02 * GIB), max_clients=64), nofile=256)
    held: list[socket.socket] = []
    try:
        with CacheClient(endpoint, timeout_s=10) as early:
            assert early.call(P.Health())[0].status == "ok"
            for i in range(400):  # more than the server's open-file limit, in bursts of 16
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                held.append(c)
                if i % 16 == 15:
                    time.sleep(0.02)
            for c in held:  # a byte each: a handshake the server's full queue dropped is retried with it
                try:
                    c.send(b"\xff")
                except OSError:
                    pass
            # until its files settle, past the clients' first SYN retries (1 s and 3 s after theirs were dropped)
            last, stable_since, until = -1, time.monotonic(), time.monotonic() + 20
            while time.monotonic() < until and time.monotonic() - stable_since < 4.5:
                n = process_fds(s.pid)
                if n != last:
                    last, stable_since = n, time.monotonic()
                time.sleep(0.1)
            cpu0, t0 = process_cpu_s(s.pid), time.monotonic()
            time.sleep(3)
            busy = (process_cpu_s(s.pid) - cpu0) / (time.monotonic() - t0)
            assert busy < 0.15, f"the server used {busy:.0%} of a core while at its cap"
            assert last < 256 - 16, f"{last} files open under a limit of 256 ({busy:.0%} CPU)"
            with pytest.raises(OSError):  # a new connection is not taken (its SYNs dropped)
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            assert early.call(P.Health())[0].status == "ok"  # a connected client keeps being served
        for h in held:
            h.close()
        held.clear()
        t0 = time.monotonic()
        with CacheClient(endpoint, timeout_s=10) as late:  # and new ones get in once others left
            assert late.call(P.Health(), timeout=10)[0].status == "ok"
        assert time.monotonic() - t0 < 5
        assert s.alive()
    finally:
        for h in held:
            h.close()
        s.close()
