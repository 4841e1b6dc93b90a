"""Start a cache server as its own process (`python -m hybridkv.cli serve ...`) and wait until it is ready.

Used by the harness runner, the benchmarks and the tests: the server under measurement is always a
separate process, as it is in production, so its VRAM, mapped libraries and CPU time are its own.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from hybridkv.server.front.cli import server_argv
from hybridkv.settings_sources import ENV_PREFIX, OTHER_ENV

if TYPE_CHECKING:
    from hybridkv.server.books.config import ServerConfig


class ServerStartError(RuntimeError):
    """The server process exited or stayed silent instead of printing its ready line."""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    endpoint: str
    arena_path: str
    metrics_url: str | None = None  # the Prometheus endpoint, when started with --metrics-port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal the server and wait; kills it if it does not exit in time. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode != 0:
            Path(self.arena_path).unlink(missing_ok=True)  # a killed server cannot unlink its own arena
        return self.proc.returncode

    def close(self) -> None:
        """Stop the server if it still runs (SIGKILL) and release the pipes to it."""
        self.stop(signal.SIGKILL, timeout=10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def _log_file() -> tuple[int, TextIO]:
    """The server's stderr when the caller reads it afterwards (the default, `stderr=PIPE`): an unlinked file the
    server appends to, and a reader of it from the start (`proc.stderr.read()` returns what was written so far). A
    pipe nobody read while the server ran filled at 64 KiB, and the server's next log line then blocked its loop
    for good: a client that made it log (768 engines left silent until reclaimed) hung the server."""
    fd, path = tempfile.mkstemp(prefix="hybridkv-server-", suffix=".log")
    try:
        writer = os.open(path, os.O_WRONLY | os.O_APPEND)  # the reader's position never moves the writes
    finally:
        os.unlink(path)
    return writer, os.fdopen(fd, encoding="utf-8", errors="replace")


def start_server(config: ServerConfig, *, log_level: str = "warning", log_format: str = "text",
                 metrics_port: int | None = None, headline_interval: float | None = None,
                 ready_timeout: float = 60.0, stderr=subprocess.PIPE, nofile: int = 0) -> ServerProcess:
    """Run `hybridkv serve` with `config` in a new process; returns once it printed its ready line.
    The keywords are the process's own: its logging, its metrics endpoint (`metrics_port` 0: any free port),
    and `nofile` > 0, the open-file limit it starts under, soft and hard (as `ulimit -n` in its shell would)."""
    # --exit-with-parent: a starter killed by SIGKILL leaves no server (and no arena in /dev/shm) behind
    process = ["--log-level", log_level, "--log-format", log_format,
               *(["--metrics-port", str(metrics_port)] if metrics_port is not None else []),
               *(["--headline-interval", str(headline_interval)] if headline_interval is not None else [])]
    cmd = [sys.executable, "-m", "hybridkv.cli", "serve", *server_argv(replace(config, parent_pid=os.getpid())),
           *process]
    # The server runs `config` alone: no HYBRIDKV_<FLAG> variable of this process reaches its flags' defaults. A
    # CPU-only server sees no GPU from its first instruction (serve also hides them itself); only the cuda_ipc
    # baseline needs one.
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) or k in OTHER_ENV}
    if not config.cuda_ipc:
        env["CUDA_VISIBLE_DEVICES"] = ""
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    log = _log_file() if stderr is subprocess.PIPE else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log[0] if log else stderr, text=True, env=env,
                                preexec_fn=limit)
    finally:
        if log:
            os.close(log[0])  # the server holds its own descriptor
    if log:
        proc.stderr = log[1]
    deadline = time.monotonic() + ready_timeout
    line = ""
    out = proc.stdout
    assert out is not None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline()
                break
    except BaseException:  # Ctrl-C while starting: no server may outlive its starter
        proc.kill()
        proc.wait()
        _remove_arenas_of(proc.pid, config.l1_dir)
        raise
    if "ready" not in line:
        proc.kill()
        _remove_arenas_of(proc.pid, config.l1_dir)
        err = proc.stderr.read() if proc.stderr not in (None, subprocess.DEVNULL) else ""
        proc.wait()
        raise ServerStartError(f"cache server did not start ({' '.join(cmd[3:])}): {line.strip()} {err.strip()}")
    arena = line.split("arena=")[1].split()[0]
    metrics = line.split("metrics=")[1].split()[0] if "metrics=" in line else None
    return ServerProcess(proc, config.endpoint, arena, metrics)


def _remove_arenas_of(pid: int, l1_dir: str) -> None:
    """A server killed before it was ready may have left its arena file: remove it by its pid."""
    for f in Path(l1_dir).glob(f"hybridkv-{pid}-*.arena"):
        f.unlink(missing_ok=True)
