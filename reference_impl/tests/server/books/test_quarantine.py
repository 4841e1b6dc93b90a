"""The quarantine of a reclaimed engine's slots and pins (books/objects.py), on a real server process: it counts the
server's running time, as the client timeout does."""

from __future__ import annotations

import os
import signal
import time

import pytest
from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P
from serverkit import Engine, counters


def wait_for(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.02)
    return v


@pytest.mark.slow  # it pauses the server 6 s on purpose
def test_a_server_paused_past_the_quarantine_keeps_a_reclaimed_engines_slots_and_pins(server_factory):
    """The quarantine counted wall time: a server stopped (SIGSTOP, a VM pause) for longer than --quarantine freed a
    reclaimed engine's reserved slots and let go of its leased objects' pins at its first tick after, though the
    engine, which may still be copying into those slots or reading those objects, had had none of the server's
    running time since. It counts the server's running time now, as the client timeout does."""
    srv = server_factory("--quarantine", "5", client_timeout=0.5)
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
            # the pause under test: longer than the quarantine, by the wall clock (a quarantine of 5 s leaves this
            # test seconds of a loaded machine between the Stats above and the stop)
            time.sleep(6)
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        # the loop turn that counted the pause as a stall ticks (its quarantine's deadlines looked at) after its
        # requests: a request answered in a later turn sees what that tick did
        wait_for(lambda: counters(admin)["loop_stalls"] > before["loop_stalls"])
        after = counters(admin)
        assert after["l1_quarantined_slots"] == 8 and after["l1_pinned_objects"] == 12, after
        # and the quarantine still ends, by the server's running time
        wait_for(lambda: (s := counters(admin))["l1_quarantined_slots"] == 0 and s["l1_pinned_objects"] == 0)
