"""The runner's cache server, from outside: is one answering (`--server`), a watchdog that fails a case the
moment its server exits, and where its log is."""

from __future__ import annotations

import threading
from pathlib import Path

from hybridkv.engine.client import CacheClient, ServerTimeout
from hybridkv.server.front.launch import ServerProcess
from hybridkv.wire import protocol as P

from hybridkv_bench.run.options import BenchError


def ping_server(endpoint: str, timeout_s: float = 5.0) -> None:
    """Raise BenchError unless a hybridkv server answers a health request at `endpoint`."""
    if not endpoint.startswith(("ipc://", "tcp://")):
        raise BenchError(f"--server {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
    client = CacheClient(endpoint, timeout_s=timeout_s)
    try:
        client.call(P.Health(), timeout=timeout_s + 1)
    except (ServerTimeout, TimeoutError):
        raise BenchError(f"--server {endpoint}: no hybridkv server answered within {timeout_s:g} s") from None
    finally:
        client.close()


class ServerWatch:
    """Closes the case's client sockets the moment its server exits, so engines fail now, not at a timeout."""

    def __init__(self, server: ServerProcess, clients: list[CacheClient]):
        self.server, self.clients = server, clients
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hkv-bench-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.05):
            if not self.server.alive():
                for c in list(self.clients):
                    c.close()
                return

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join()


def server_log(folder: Path, label: str) -> Path:
    """Where the server of case `label` ("workload/case") writes its log in run folder `folder`."""
    return folder / "server-logs" / f"{label.replace('/', '--')}.log"


def log_tail(log: Path) -> str:
    """The last non-blank line of a server log, as " (last log line: ...)", or "" when there is none."""
    try:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    except OSError:
        return ""
    return f" (last log line: {lines[-1].strip()})" if lines else ""
