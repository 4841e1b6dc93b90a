"""Fixtures: real cache-server processes on private ipc endpoints, and clients for them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hybridkv.engine.client import CacheClient
from serverkit import spawn_server


@pytest.fixture
def sock_dir():
    # ipc paths are limited to ~100 characters: keep them short, not under pytest's deep tmp_path
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    yield d
    for f in Path(d).iterdir():
        f.unlink()
    os.rmdir(d)


@pytest.fixture
def server_factory(sock_dir):
    procs = []

    def start(*args: str, **kw):
        kw.setdefault("name", f"s{len(procs)}")
        s = spawn_server(sock_dir, *args, **kw)
        procs.append(s)
        return s

    yield start
    for s in procs:
        s.close()


@pytest.fixture
def server(server_factory):
    return server_factory()


@pytest.fixture
def client(server):
    c = CacheClient(server.endpoint, timeout_s=10)
    yield c
    c.close()
