"""16 client processes against one server, three misbehaving: nobody stalls, memory stays bounded."""

from __future__ import annotations

import pytest
from load_server import run


@pytest.mark.slow
def test_sixteen_clients_with_a_non_reader_a_vanisher_and_a_pin_holder(server_factory):
    srv = server_factory("--max-queued-replies", "100", "--max-leases", "256", l1_gib=0.25, client_timeout=5)
    res = run(srv.endpoint, srv.pid, seconds=8)
    assert srv.alive() and res["finished"] == res["processes"] == 16
    assert res["corrupt_objects"] == 0 and res["lookup_p50_ms"] is not None
    assert res["worst_call_s"] < 10, f"a well-behaved engine waited {res['worst_call_s']:.1f}s for one call"
    assert res["rss_max_mib"] < 256, res["rss_max_mib"]
    roles = {r["role"]: r for r in res["misbehaving"]}
    assert roles["holds_pins"]["refused"] > 0 and roles["disconnects"]["vanished"] >= 1
