"""Suite-wide set-up and the one server fixture every component's tests share.

Without CUDA, Triton kernels run under Triton's CPU interpreter; the switch must be set before triton is
first imported, so it lives here rather than in one component's conftest. `server_factory` starts real
`hybridkv serve` processes on private ipc endpoints and stops them (arena removed) however the test ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
from hybridkv.server.front.cli import parse_args, server_config
from hybridkv.server.front.launch import ServerProcess, start_server

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A private directory for ipc sockets: ipc paths are limited to ~100 characters, so not pytest's tmp_path."""
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server_factory(sock_dir: str) -> Iterator[Callable[..., ServerProcess]]:
    """start(*flags, name=, l1_gib=, client_timeout=, admin=True) -> a ready server; all are stopped at the end.
    Test servers open Stats to every client (--admin) unless a test checks what a plain server refuses."""
    procs: list[ServerProcess] = []

    def start(*args: str, name: str | None = None, l1_gib: float = 0.05, client_timeout: float = 30.0,
              admin: bool = True) -> ServerProcess:
        extra = ("--admin",) if admin else ()
        flags = parse_args([f"--endpoint=ipc://{sock_dir}/{name or f's{len(procs)}'}.sock", f"--l1-gib={l1_gib}",
                            f"--client-timeout={client_timeout}", *args, *extra])
        s = start_server(server_config(flags), metrics_port=flags.metrics_port)
        procs.append(s)
        return s

    yield start
    for s in procs:
        s.close()
