"""Start a cache server as its own process (`python -m hybridkv.cli serve ...`) and wait until it is ready.

Used by the harness runner, the benchmarks and the tests: the server under measurement is always a
separate process, as it is in production, so its VRAM, mapped libraries and CPU time are its own.
"""

from __future__ import annotations

import io
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

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
        if self.proc.returncode != 0 and not self.arena_path.startswith("/proc/"):  # a memfd went with its server
            Path(self.arena_path).unlink(missing_ok=True)  # a killed server cannot unlink its own arena
        return self.proc.returncode

    def close(self) -> None:
        """Stop the server if it still runs (SIGKILL) and release the pipes to it."""
        self.stop(signal.SIGKILL, timeout=10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


# What start_server keeps of a server's stderr (the default, `stderr=PIPE`): its first lines (start-up, the first
# failure) and its last, the middle left out with a count. The whole of it went to an unlinked file that grew for
# as long as the server ran, and a client decides how much a server logs (a warning per engine it leaves silent).
STDERR_HEAD_BYTES = 64 << 10
STDERR_TAIL_BYTES = 1 << 20


class StderrTail(io.TextIOBase):
    """A server's stderr as start_server keeps it: a pipe a thread of ours drains as the server writes, so the server
    never waits on it (a pipe nobody read until the server stopped filled at 64 KiB and blocked its loop for good),
    into at most `head` + `tail` bytes. `read()` returns what arrived since the last read, as a file's would; once the
    server has exited, everything it wrote."""

    def __init__(self, fd: int, proc: subprocess.Popen):
        super().__init__()
        self._fd, self._proc, self._head_room, self._tail_room = fd, proc, STDERR_HEAD_BYTES, STDERR_TAIL_BYTES
        self._head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        self._left_out = 0
        self._lock = threading.Lock()
        self._drain = threading.Thread(target=self._read_all, name=f"server-{proc.pid}-stderr", daemon=True)
        self._drain.start()

    def _read_all(self) -> None:
        while chunk := os.read(self._fd, 1 << 16):
            with self._lock:
                room = self._head_room - len(self._head)
                if room > 0:
                    self._head += chunk[:room]
                    chunk = chunk[room:]
                self._tail.append(chunk)
                self._tail_bytes += len(chunk)
                excess = self._tail_bytes - self._tail_room
                while excess > 0:  # the oldest bytes go, to the byte
                    first = self._tail.popleft()
                    if len(first) > excess:
                        self._tail.appendleft(first[excess:])
                    cut = min(len(first), excess)
                    self._tail_bytes -= cut
                    self._left_out += cut
                    excess -= cut
        os.close(self._fd)

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        if self._proc.poll() is not None:
            self._drain.join(timeout=10)  # the server is gone: what it wrote last is still in the pipe
        with self._lock:
            gap = f"\n[... {self._left_out} bytes of the server's stderr left out ...]\n" if self._left_out else ""
            data = bytes(self._head) + gap.encode() + b"".join(self._tail)  # the gap on a line of its own
            self._head_room -= len(self._head)
            self._head.clear()
            self._tail.clear()
            self._tail_bytes = self._left_out = 0
        return data.decode("utf-8", errors="replace")

    def close(self) -> None:
        """The pipe closes when the server has exited and the thread read it to the end."""
        if self._proc.poll() is not None:
            self._drain.join(timeout=10)
        super().close()


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
    pipe = os.pipe() if stderr is subprocess.PIPE else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=pipe[1] if pipe else stderr, text=True, env=env,
                                preexec_fn=limit)
    except BaseException:
        if pipe:
            os.close(pipe[0])
        raise
    finally:
        if pipe:
            os.close(pipe[1])  # the server holds its own end
    if pipe:
        proc.stderr = cast(IO[str], StderrTail(pipe[0], proc))
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
        proc.wait()  # exited: its stderr is read to the end
        _remove_arenas_of(proc.pid, config.l1_dir)
        err = proc.stderr.read() if proc.stderr not in (None, subprocess.DEVNULL) else ""
        raise ServerStartError(f"cache server did not start ({' '.join(cmd[3:])}): {line.strip()} {err.strip()}")
    arena = line.split("arena=")[1].split()[0]
    metrics = line.split("metrics=")[1].split()[0] if "metrics=" in line else None
    return ServerProcess(proc, config.endpoint, arena, metrics)


def _remove_arenas_of(pid: int, l1_dir: str) -> None:
    """A server killed before it was ready may have left its arena file: remove it by its pid."""
    for f in Path(l1_dir).glob(f"hybridkv-{pid}-*.arena"):
        f.unlink(missing_ok=True)
