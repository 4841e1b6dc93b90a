"""A CPU engine's mapping of the server's arena is populated at registration, off the hot path: the first load out
of it faults no page (each fault was the kernel's time on a warm request's path)."""

from __future__ import annotations

import os
import resource
import sys
import uuid

import pytest
import torch
from hybridkv.engine.wire import ArenaMapping

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")

SIZE = 32 << 20


@pytest.fixture
def arena():
    """A file laid out as the server lays out its arena: allocated whole, in /dev/shm, written."""
    path = f"/dev/shm/hkv-test-prefault-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, SIZE)
        os.pwrite(fd, bytes(range(256)) * (SIZE // 256), 0)
    finally:
        os.close(fd)
    yield path
    os.unlink(path)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_cpu_mapping_is_populated_before_its_first_read(arena):
    m = ArenaMapping(arena, SIZE, torch.device("cpu"))
    try:
        assert m.prefault is not None and m.prefault.done.wait(30)
        if not m.prefault.populated:
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14+): pages fault in on first use")
        pages = m.tensor.numpy()
        before = _faults()
        first = pages[::4096].copy()  # one byte of every page
        faults = _faults() - before
        assert not first.any()  # the bytes written: every page starts with byte 0 of the pattern
        assert faults < 8, f"{faults} page faults reading a populated mapping"
    finally:
        m.close()


def test_closing_stops_the_populate_first(arena):
    """A mapping closed at once (an engine that leaves right after registering) waits for the slice in flight,
    never unmaps under it."""
    m = ArenaMapping(arena, SIZE, torch.device("cpu"))
    m.close()
    assert m.prefault is not None and m.prefault.done.is_set()
