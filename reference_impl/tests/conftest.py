"""Fixtures: a server and a client for it (`server_factory` and `sock_dir` come from the suite-wide conftest)."""

from __future__ import annotations

import pytest
from hybridkv.engine.client import CacheClient


@pytest.fixture
def server(server_factory):
    return server_factory()


@pytest.fixture
def client(server):
    c = CacheClient(server.endpoint, timeout_s=10)
    yield c
    c.close()
