"""A server killed by a fatal signal says so on stderr (serve enables faulthandler), on a real server process."""

from __future__ import annotations

import os
import signal

import pytest
from hybridkv.engine.client import CacheClient, ServerTimeout
from hybridkv.wire import protocol as P
from serverkit import Engine


def test_a_server_killed_by_its_truncated_arena_says_where(server_factory):
    """A process of the server's uid truncated the arena file under a live server: the server's next copy touching
    a page past the new end was a SIGBUS, and the server vanished without a word (exit -7, stderr empty). Nothing
    that maps the arena can be kept from this (its uid may write the file; docs/trust-model.md), but the death now
    leaves its cause on stderr: the fatal signal and every thread's stack."""
    srv = server_factory()
    with CacheClient(srv.endpoint, timeout_s=5) as c:
        eng = Engine(c)
        keys = eng.keys(2, seed=3)
        eng.store(keys)
        lease = eng.lookup(keys, policy="all").lease
        os.truncate(srv.arena_path, 0)
        with pytest.raises((ServerTimeout, TimeoutError)):  # no answer comes
            c.call(P.Retrieve(engine=eng.id, lease=lease, format="raw"), timeout=0.5)  # the server reads the slots
        assert srv.proc.wait(timeout=30) == -signal.SIGBUS
    assert srv.proc.stderr is not None
    err = srv.proc.stderr.read()
    assert "Fatal Python error: Bus error" in err and "in serve_forever" in err, err[-3000:]
