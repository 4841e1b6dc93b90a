"""Sessions against real server processes: an engine, its leases and its reservations belong to the connection
that made them (another connection is answered as if they did not exist), and their ids cannot be guessed."""

from __future__ import annotations

from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P
from serverkit import Engine, expect

E = P.ErrorCode


def test_another_connection_cannot_use_an_engine_lease_or_reservation(server):
    with CacheClient(server.endpoint, timeout_s=10) as ca, CacheClient(server.endpoint, timeout_s=10) as cb:
        a = Engine(ca)
        keys = a.keys(3, seed=2)
        a.store(keys)
        hit = a.lookup(keys)
        prep, _ = ca.call(P.PrepareStore(engine=a.id, request="r", keys=a.keys(1, seed=3), objects=[(0, 0)]))
        for msg in (P.Lookup(engine=a.id, request="x", keys=keys), P.Heartbeat(engine=a.id),
                    P.Release(engine=a.id, lease=hit.lease), P.Retrieve(engine=a.id, lease=hit.lease),
                    P.CommitStore(engine=a.id, reservation=prep.reservation),
                    P.AbortStore(engine=a.id, reservation=prep.reservation),
                    P.EndSession(engine=a.id, request="r"), P.Clear(engine=a.id), P.Unregister(engine=a.id)):
            expect(E.UNKNOWN_ENGINE, lambda m=msg: cb.call(m))
        b = Engine(cb)
        # b's own engine id with a's lease or reservation is not b's either
        expect(E.UNKNOWN_LEASE, lambda: cb.call(P.Release(engine=b.id, lease=hit.lease)))
        expect(E.UNKNOWN_RESERVATION, lambda: cb.call(P.AbortStore(engine=b.id, reservation=prep.reservation)))
        # a's state is intact: its lease still pins, its reservation still commits
        ca.call(P.CommitStore(engine=a.id, reservation=prep.reservation))
        assert ca.call(P.Release(engine=a.id, lease=hit.lease))[0].count == len(hit.objects)


def test_ids_are_not_sequential(client):
    ids = [Engine(client).id for _ in range(4)]
    assert len(set(ids)) == 4 and all(i >= 1 << 32 for i in ids)
    assert all(abs(x - y) > 1 << 16 for x in ids for y in ids if x != y)
