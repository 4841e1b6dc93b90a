"""`hybridkv serve` processes with L2 on a real redis-server: two hosts sharing it, tenants, a dead store.

Each server has its own arena and L1 (a host each); they share one Redis. Payloads are deterministic
from the key (serverkit.Engine.payload), so every byte handed out is checked.
"""

from __future__ import annotations

import json
import time

import pytest
import rediskit
from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P
from serverkit import Engine, counters, lookup_checked, settled

pytestmark = pytest.mark.skipif(rediskit.skip_reason() is not None, reason=str(rediskit.skip_reason()))

TINY_L1 = 1 / 1024  # 1 MiB: 51 tiny-hybrid objects of 20 KiB, under 13 chunks


@pytest.fixture
def store():
    r = rediskit.RedisProcess()
    yield r
    r.close()


def redis_flags(store, prefix: str = "hybridkv:", *extra: str) -> tuple[str, ...]:
    spec = {"type": "redis", "url": store.url, "prefix": prefix, "retry_after_s": 0.2}
    return ("--l2-adapter", json.dumps(spec), *extra)




def test_prefix_stored_on_host_a_hits_on_host_b(server_factory, store):
    """A stores more than its L1 holds (spills go to Redis), then exits flushing the rest; B hits all of it."""
    a = server_factory(*redis_flags(store, "hybridkv:", "--flush-on-exit"), name="a", l1_gib=TINY_L1)
    b = server_factory(*redis_flags(store), name="b", l1_gib=TINY_L1)
    with CacheClient(a.endpoint, timeout_s=10) as ca, CacheClient(b.endpoint, timeout_s=10) as cb:
        ea, eb = Engine(ca), Engine(cb)
        assert ea.arena is not eb.arena and a.arena_path != b.arena_path
        first, second = ea.keys(8, seed=1), ea.keys(8, seed=2)
        ea.store(first)
        ea.store(second)  # pushes `first` out of A's L1, into Redis
        assert settled(ca)["l2_spills"] > 0  # the spills A started have ended (the oldest, `first`'s first chunk)
        res = eb.lookup(first, policy="all")  # A is still up: B reads what A spilled so far
        assert res.hit_chunks >= 1
        eb.check(first, res)
        cb.call(P.Release(engine=eb.id, lease=res.lease))
        assert counters(cb)["l2_prefetch_bytes"] > 0
        a.stop()  # flush-on-exit: what A still held in L1 lands in Redis
        time.sleep(0.3)  # B trusts the misses it just saw for miss_ttl_s (0.25 s by default)
        groups = len(eb.layout.groups)
        for doc in (first, second):
            res = lookup_checked(eb, doc, 8)
            assert {(o.chunk, o.group) for o in res.objects} == {(c, g) for c in range(8) for g in range(groups)}
        assert lookup_checked(eb, eb.keys(8, seed=3), 0).hit_chunks == 0


def test_tenant_prefixes_do_not_see_each_other(server_factory, store):
    """Two servers on one Redis with different prefixes: what one stores is a miss for the other."""
    a = server_factory(*redis_flags(store, "tenant-a:", "--flush-on-exit"), name="a", l1_gib=TINY_L1)
    b = server_factory(*redis_flags(store, "tenant-b:"), name="b", l1_gib=TINY_L1)
    with CacheClient(a.endpoint, timeout_s=10) as ca, CacheClient(b.endpoint, timeout_s=10) as cb:
        ea, eb = Engine(ca), Engine(cb)
        keys = ea.keys(6, seed=4)
        ea.store(keys)
        a.stop()
        assert store.client().keys("tenant-a:m:*")
        lookup_checked(eb, keys, 0)
        assert not store.client().keys("tenant-b:*")


def test_store_killed_and_restarted_mid_run(server_factory, store):
    """With Redis dead the server keeps serving from L1 (spills fail, counted); after a restart it spills again."""
    s = server_factory(*redis_flags(store), name="a", l1_gib=TINY_L1)
    with CacheClient(s.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        docs = [eng.keys(6, seed=10 + i) for i in range(6)]
        eng.store(docs[0])
        eng.store(docs[1])
        store.kill()
        for d in docs[2:4]:
            eng.store(d)  # L1 pressure: spills to a dead store fail, the server goes on
            lookup_checked(eng, d, 6)
        st = counters(c)
        assert st["l2_spill_failures"] > 0 and st["l2_store_up"] == 0
        res = eng.lookup(docs[0], policy="all")  # spilled before the kill, now gone: a miss, never garbage
        eng.check(docs[0], res)
        if res.lease:
            c.call(P.Release(engine=eng.id, lease=res.lease))
        store.start()
        for d in docs[4:]:
            eng.store(d)
        lookup_checked(eng, docs[5], 6)
        assert s.alive()
        assert c.call(P.Health())[0].status == "ok"


@pytest.fixture
def cluster():
    c = rediskit.started_cluster()
    yield c
    c.close()


def lookup_bytes_checked(eng: Engine, keys: list[bytes]) -> int:
    """Look up every group, verify every byte handed out, release; how many chunks hit (misses allowed)."""
    res = eng.lookup(keys, policy="all")
    eng.check(keys, res)
    if res.lease:
        eng.client.call(P.Release(engine=eng.id, lease=res.lease))
    return res.hit_chunks


def metas_by_node(cluster) -> list[list[bytes]]:
    """The namespace of every object's meta on each node (SCAN of each node: it holds only its slots)."""
    from hybridkv.server.l2.header import HEADER_BYTES, ObjectHeader

    out = []
    for r in cluster.nodes:
        c = r.client()
        out.append([ObjectHeader.unpack(c.get(n)[:HEADER_BYTES]).ns for n in c.scan_iter(match=b"hybridkv:m:*")])
    return out


@pytest.mark.slow
def test_a_server_on_a_cluster_spills_reshards_clears_and_loses_a_node(server_factory, cluster):
    """`hybridkv serve` with a 3-node Redis Cluster as L2: what spills from its 1 MiB L1 lands on every node and
    is read back byte-exact; a `redis-cli --cluster reshard` while lookups run hands out no wrong byte; Clear of
    one namespace removes its objects on every node and only them; a node killed makes its objects misses while
    the server keeps serving, storing and answering Health."""
    import threading

    s = server_factory(*redis_flags(cluster), name="a", l1_gib=TINY_L1)
    with CacheClient(s.endpoint, timeout_s=20) as c:
        eng, other = Engine(c), Engine(c, salt="another-tenant")
        docs = [eng.keys(6, seed=20 + i) for i in range(8)]
        theirs = [other.keys(6, seed=40 + i) for i in range(3)]
        for d in docs + theirs:
            eng.store(d) if d in docs else other.store(d)
        for d in docs:  # most were pushed out of L1 into the cluster by those after them: read back from there
            lookup_checked(eng, d, 6)
        st = counters(c)
        assert st["l2_spills"] > 0 and st["l2_prefetch_bytes"] > 0 and st["l2_cluster_nodes"] == 3
        per_node = metas_by_node(cluster)
        assert all(len(m) > 3 for m in per_node), [len(m) for m in per_node]

        src, dst = cluster.nodes[0], cluster.nodes[1]
        reshard = threading.Thread(target=cluster.cli, args=(
            "--cluster", "reshard", f"127.0.0.1:{src.port}", "--cluster-from", cluster.node_id(src),
            "--cluster-to", cluster.node_id(dst), "--cluster-slots", "2000", "--cluster-yes"))
        reshard.start()
        rounds = 0
        while reshard.is_alive() or rounds < 2:
            for d in docs:
                lookup_bytes_checked(eng, d)
            rounds += 1
        reshard.join()
        time.sleep(0.3)
        for d in docs:
            lookup_checked(eng, d, 6)

        ns_other = other.reg.namespace
        assert any(ns_other in m for m in metas_by_node(cluster))
        assert c.call(P.Clear(engine=other.id))[0].count > 0
        after = metas_by_node(cluster)
        assert all(ns_other not in m and m for m in after), [len(m) for m in after]
        time.sleep(0.3)
        assert all(lookup_bytes_checked(other, d) == 0 for d in theirs)

        cluster.nodes[2].kill()
        hits = [lookup_bytes_checked(eng, d) for d in docs for _ in range(2)]
        assert sum(hits) < 2 * 6 * len(docs), hits  # the dead node's objects are gone: misses
        for i in range(4):
            fresh = eng.keys(6, seed=60 + i)
            eng.store(fresh)
            lookup_checked(eng, fresh, 6)
        assert s.alive() and c.call(P.Health())[0].status == "ok"
        st = counters(c)
        assert st["l2_store_up"] == 1 and st["l2_cluster_nodes_up"] == 2, st
