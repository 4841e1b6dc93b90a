"""`--l1-memfd`: the arena a memfd sealed against shrinking, opened by engines as /proc/<pid>/fd/<n>, on real server
processes: an engine maps it as it maps the file, and nobody can truncate it under the server (with a named arena
file, the truncation in test_fatal_signals.py is a SIGBUS)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse, server_argv
from hybridkv.wire import protocol as P
from serverkit import Engine


def test_a_sealed_arena_refuses_truncation_and_serves_every_byte(server_factory, tmp_path):
    """Truncated by path and through an fd of its own, as a process of the server's uid would: both refused
    (EPERM); the raw Retrieve that read past the new end of a truncated file answers with every byte stored; no
    arena file is made in --l1-dir, and the server's exit leaves none."""
    l1_dir = tmp_path / "l1"
    l1_dir.mkdir()
    srv = server_factory("--l1-memfd", "--l1-dir", str(l1_dir))
    assert srv.arena_path == f"/proc/{srv.pid}/fd/{Path(srv.arena_path).name}"
    with CacheClient(srv.endpoint, timeout_s=30) as c:
        eng = Engine(c)  # maps the arena by the path it was given
        assert eng.reg.arena_path == srv.arena_path
        keys = eng.keys(4, seed=3)
        eng.store(keys)
        res = eng.lookup(keys, policy="all")
        eng.check(keys, res)
        with pytest.raises(PermissionError):
            os.truncate(srv.arena_path, 0)
        fd = os.open(srv.arena_path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
            assert os.fstat(fd).st_size == eng.reg.arena_bytes
        finally:
            os.close(fd)
        got, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw"))
        for o, f in zip(got.objects, frames, strict=True):
            assert np.array_equal(np.frombuffer(f, np.uint8), eng.payload(keys[o.chunk], o.group, o.length))
        assert srv.alive()
    assert list(l1_dir.iterdir()) == []
    assert srv.stop() == 0
    assert list(l1_dir.iterdir()) == []


def test_the_flag_round_trips_through_server_argv(sock_dir):
    config = parse([f"--endpoint=ipc://{sock_dir}/s.sock", "--l1-memfd"])
    assert config.l1_memfd and parse(server_argv(config)) == config
    assert not parse([f"--endpoint=ipc://{sock_dir}/s.sock"]).l1_memfd
