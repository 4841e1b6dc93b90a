"""Administration against a real server process: Clear and Stats of every tenant need --admin; an engine's Clear
reaches its own namespace only."""

from __future__ import annotations

from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P
from serverkit import Engine, expect

E = P.ErrorCode


def test_clear_and_stats_of_everyone_need_admin_and_clear_is_scoped(server_factory):
    srv = server_factory(admin=False)
    with CacheClient(srv.endpoint, timeout_s=10) as ca, CacheClient(srv.endpoint, timeout_s=10) as cb:
        a, b = Engine(ca), Engine(cb, salt="tenant-b")
        ka, kb = a.keys(2, seed=4), b.keys(2, seed=5)
        a.store(ka)
        b.store(kb)
        expect(E.FORBIDDEN, lambda: cb.call(P.Clear()))
        expect(E.FORBIDDEN, lambda: cb.call(P.Stats()))
        assert cb.call(P.Clear(engine=b.id))[0].count == 8  # b's own namespace only
        assert a.lookup(ka).hit_chunks == 2 and b.lookup(kb).hit_chunks == 0
