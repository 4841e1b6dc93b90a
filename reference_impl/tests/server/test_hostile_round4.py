"""Hostile clients and host faults against real server processes, this round's findings: a paused server and the
quarantine, and a log a client can make as long as it likes."""

from __future__ import annotations

import os
import re
import signal
import stat
import time

import pytest
from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.engine.pending import ServerTimeout
from hybridkv.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front import launch
from hybridkv.server.front.launch import start_server
from serverkit import Engine, counters


def wait_for(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.02)
    return v


@pytest.mark.slow  # it pauses the server 3 s on purpose
def test_a_server_paused_past_the_quarantine_keeps_a_reclaimed_engines_slots_and_pins(server_factory):
    """The quarantine counted wall time: a server stopped (SIGSTOP, a VM pause) for longer than --quarantine freed a
    reclaimed engine's reserved slots and let go of its leased objects' pins at its first tick after, though the
    engine, which may still be copying into those slots or reading those objects, had had none of the server's
    running time since. It counts the server's running time now, as the client timeout does."""
    srv = server_factory("--quarantine", "2", client_timeout=0.5)
    with CacheClient(srv.endpoint, timeout_s=30) as admin, CacheClient(srv.endpoint, timeout_s=30) as c:
        gone = Engine(c)
        keys = gone.keys(3, seed=41)
        gone.store(keys)
        lease = gone.lookup(keys, policy="all").lease  # 12 objects pinned
        prep, _ = c.call(P.PrepareStore(engine=gone.id, request="w", keys=gone.keys(2, seed=42),
                                        objects=[(k, g) for k in range(2) for g in range(4)]))
        assert lease and len(prep.slots) == 8
        # the engine falls silent (its copies may still land): reclaimed, 8 slots quarantined, 12 pins kept
        before = wait_for(lambda: (s := counters(admin))["engines_reclaimed"] == 1 and s)
        assert before["l1_quarantined_slots"] == 8 and before["l1_pinned_objects"] == 12, before
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            time.sleep(3)  # the pause under test: longer than the quarantine, by the wall clock
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        # the loop turn that counted the pause as a stall ticks (its quarantine's deadlines looked at) after its
        # requests: a request answered in a later turn sees what that tick did
        wait_for(lambda: counters(admin)["loop_stalls"] > before["loop_stalls"])
        after = counters(admin)
        assert after["l1_quarantined_slots"] == 8 and after["l1_pinned_objects"] == 12, after
        # and the quarantine still ends, by the server's running time
        wait_for(lambda: (s := counters(admin))["l1_quarantined_slots"] == 0 and s["l1_pinned_objects"] == 0)


def test_a_servers_stderr_is_kept_to_its_head_and_tail_however_much_a_client_makes_it_log(sock_dir, monkeypatch):
    """start_server kept a server's whole stderr in an unlinked file: a client decides how much the server logs (a
    warning per engine it leaves silent until reclaimed), so the file grew on the starter's disk for as long as the
    server ran. The starter now drains a pipe into its first and last bytes (here 2 and 8 KiB), the middle counted."""
    monkeypatch.setattr(launch, "STDERR_HEAD_BYTES", 2048, raising=False)
    monkeypatch.setattr(launch, "STDERR_TAIL_BYTES", 8192, raising=False)
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/t.sock", l1_bytes=int(0.02 * GIB),
                                       client_timeout_s=0.5, admin=True))
    try:
        layout = preset_layout("tiny-hybrid")
        with CacheClient(server.endpoint, timeout_s=30) as c:
            for i in range(64):  # ~200 bytes of warning each: 12 KiB and more
                c.call(P.Register(layout=layout, chunk_tokens=0, name=f"silent-{i:02d}-" + "x" * 100))
            with CacheClient(server.endpoint, timeout_s=30) as admin:
                wait_for(lambda: counters(admin)["engines_reclaimed"] == 64)
            held = os.stat(f"/proc/{server.pid}/fd/2")
            assert not stat.S_ISREG(held.st_mode) or held.st_size <= 2048 + 8192, held
        assert server.stop() == 0
        assert server.proc.stderr is not None
        err = server.proc.stderr.read()
    finally:
        server.close()
    gap = re.search(r"\n\[\.\.\. (\d+) bytes of the server's stderr left out \.\.\.\]\n", err)
    assert gap, err
    head, tail = err[:gap.start()], err[gap.end():]
    assert len(head) == 2048 and len(tail) == 8192, (len(head), len(tail))
    assert "silent-00-" in head and "silent-63-" in tail  # the first and the last
    assert 0 < err.count("silent for") < 64


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
