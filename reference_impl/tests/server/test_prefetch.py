"""Prefetch ahead of need, end to end: real server processes on a real L2 directory.

An evicted prefix comes back to L1 before its lookup (which then answers without waiting on L2), a
namespace reaches only its own objects, bad requests are refused with no state change, a prefetch
racing a lookup of the same objects reads each object once, and an L1 full of pinned or reserved
objects refuses the prefetch instead of evicting them. Bytes are checked as in test_l2_server.
"""

from __future__ import annotations

import time

import pytest
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from serverkit import Engine, RawDealer
from test_l2_server import TINY_L1, counters, fill, l2_flags, lookup_checked

# tiny-hybrid: 1 attention + 3 recurrent groups; a boundary resume of 5 chunks needs 5 + 3 objects
RESUME_5 = 8


@pytest.fixture
def l2_dir(tmp_path):
    return tmp_path / "l2"


def prefetch(eng: Engine, keys: list[bytes], policy: str = "boundary") -> P.Prefetching:
    r, _ = eng.client.call(P.Prefetch(engine=eng.id, keys=keys, policy=policy))
    return r


def settled(client: CacheClient, timeout_s: float = 20.0) -> dict:
    """Counters once no L2 read is in flight and no prefetch waits for room."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = counters(client)
        if c["l1_unready_objects"] == 0 and c["parked"] == 0 and c["workers_inflight"] == 0:
            return c
        assert time.monotonic() < deadline, f"reads still in flight after {timeout_s}s: {c}"
        time.sleep(0.01)


def evicted(client: CacheClient, seed: int = 1) -> tuple[Engine, list[bytes]]:
    """An engine whose 5-chunk prefix (every group stored) was pushed out of L1 into L2 by a filler."""
    eng, filler = Engine(client), Engine(client, salt="filler")
    keys = eng.keys(5, seed=seed)
    eng.store(keys)
    fill(filler, 16, seed=seed + 100)  # 84 objects for 51 slots: the oldest (these 20) are evicted first
    settled(client)
    return eng, keys


def test_prefetch_brings_an_evicted_prefix_to_l1_and_the_lookup_then_waits_on_nothing(server_factory, l2_dir):
    srv = server_factory(*l2_flags(l2_dir), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        eng, keys = evicted(client)
        before = counters(client)
        r = prefetch(eng, keys + eng.keys(2, seed=99))  # two unknown chunks after the prefix
        assert r.hit_chunks == 5
        assert r.started + r.waiting == RESUME_5 and r.in_l1 == r.loading == r.refused == 0
        c = settled(client)
        assert c["prefetch_requests"] - before["prefetch_requests"] == 1
        read = c["prefetch_objects_started"] - before["prefetch_objects_started"]
        assert read == r.started + r.waiting and c["l2_prefetches"] - before["l2_prefetches"] == read
        assert c["l1_pinned_objects"] == 0, "a prefetch pins nothing"
        lookup_checked(eng, keys, 5, policy="boundary")
        after = counters(client)
        assert after["l2_prefetches"] == c["l2_prefetches"], "the lookup read nothing from L2"
        assert after["lookup_l2_waits"] == c["lookup_l2_waits"], "the lookup did not wait on L2"
        # Again: everything is in L1 now, refreshed, nothing to read.
        again = prefetch(eng, keys)
        assert (again.in_l1, again.started, again.waiting) == (RESUME_5, 0, 0)


def test_prefetch_skips_the_attention_of_chunks_the_engine_holds(server_factory, l2_dir):
    """skip_chunks as in Lookup: the engine holds the first 3 chunks, so only chunks 3-4's attention and the
    boundary states are read; a negative count is refused with no state change."""
    srv = server_factory(*l2_flags(l2_dir), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        eng, keys = evicted(client, seed=3)
        with pytest.raises(ServerError, match="skip_chunks must be >= 0"):
            eng.client.call(P.Prefetch(engine=eng.id, keys=keys, skip_chunks=-1))
        before = settled(client)
        r, _ = eng.client.call(P.Prefetch(engine=eng.id, keys=keys, skip_chunks=3))
        assert r.hit_chunks == 5 and r.started + r.waiting == RESUME_5 - 3
        c = settled(client)
        assert c["prefetch_objects_started"] - before["prefetch_objects_started"] == RESUME_5 - 3
        res = eng.lookup(keys, skip=3)
        assert res.hit_chunks == 5 and len(res.objects) == RESUME_5 - 3
        assert counters(client)["lookup_l2_waits"] == c["lookup_l2_waits"], "the lookup did not wait on L2"


def test_a_lookup_without_prefetch_waits_on_l2(server_factory, l2_dir):
    """The reference for the test above: the same evicted prefix, looked up cold, waits for L2 reads."""
    srv = server_factory(*l2_flags(l2_dir), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        eng, keys = evicted(client)
        before = counters(client)
        lookup_checked(eng, keys, 5, policy="boundary")
        after = counters(client)
        assert after["lookup_l2_waits"] - before["lookup_l2_waits"] == 1
        assert after["l2_prefetches"] > before["l2_prefetches"]


def test_prefetch_reaches_only_its_own_namespace(server_factory, l2_dir):
    srv = server_factory(*l2_flags(l2_dir), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client, CacheClient(srv.endpoint, timeout_s=20) as other:
        eng, keys = evicted(client)
        before = counters(client)
        tenant = Engine(client, salt="tenant-b")  # same connection, another namespace
        r = prefetch(tenant, tenant.keys(5, seed=1))  # the same tokens: keys of its own namespace
        assert (r.hit_chunks, r.started, r.waiting, r.in_l1) == (0, 0, 0, 0)
        # Another connection naming this engine's id is answered as if it did not exist.
        with pytest.raises(ServerError) as e:
            other.call(P.Prefetch(engine=eng.id, keys=keys))
        assert e.value.code == P.ErrorCode.UNKNOWN_ENGINE
        c = counters(client)
        assert c["l2_prefetches"] == before["l2_prefetches"]
        assert c["prefetch_objects_started"] == before["prefetch_objects_started"]


def test_bad_prefetches_are_refused_with_no_state_change_and_the_server_keeps_serving(server_factory, l2_dir):
    srv = server_factory(*l2_flags(l2_dir), "--max-keys", "8", l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        eng, keys = evicted(client)
        before = counters(client)
        bad = {
            "duplicate key": ([keys[0], keys[1], keys[0]], P.ErrorCode.BAD_REQUEST),
            "short key": ([keys[0], keys[1][:8]], P.ErrorCode.BAD_REQUEST),
            "over --max-keys": (keys + eng.keys(4, seed=7), P.ErrorCode.LIMIT),
        }
        for what, (ks, code) in bad.items():
            with pytest.raises(ServerError) as e:
                client.call(P.Prefetch(engine=eng.id, keys=ks))
            assert e.value.code == code, what
        with pytest.raises(ServerError) as e:
            client.call(P.Prefetch(engine=eng.id, keys=keys[:1]), frames=[b"x"])
        assert e.value.code == P.ErrorCode.BAD_PAYLOAD
        with pytest.raises(ServerError) as e:
            client.call(P.Prefetch(engine=12345, keys=keys))
        assert e.value.code == P.ErrorCode.UNKNOWN_ENGINE
        raw = RawDealer(srv.endpoint)
        try:
            for msg in ({"op": "prefetch", "v": 1, "id": 1, "engine": eng.id, "keys": keys, "policy": "some"},
                        {"op": "prefetch", "v": 1, "id": 2, "engine": eng.id, "keys": "not a list"},
                        {"op": "prefetch", "v": 1, "id": 3, "keys": keys}):
                reply = raw.request(msg)
                assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_MESSAGE, (msg, reply)
        finally:
            raw.close()
        c = counters(client)
        for k in ("prefetch_requests", "prefetch_objects_started", "l2_prefetches", "l1_objects", "l1_bytes_used"):
            assert c[k] == before[k], k
        assert client.call(P.Health())[0].status == "ok"
        lookup_checked(eng, keys, 5, policy="boundary")


def test_a_prefix_larger_than_l1_is_refused(server_factory, l2_dir):
    srv = server_factory(*l2_flags(l2_dir), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        eng = Engine(client)
        keys = fill(eng, 40, seed=3)  # 160 objects: L1 holds 51
        settled(client)
        before = counters(client)
        with pytest.raises(ServerError) as e:
            prefetch(eng, keys, policy="all")
        assert e.value.code == P.ErrorCode.LIMIT and "L1 holds" in e.value.message
        assert counters(client)["l2_prefetches"] == before["l2_prefetches"]


@pytest.mark.parametrize("first", ["prefetch", "lookup"])
def test_prefetch_racing_a_lookup_reads_each_object_once(server_factory, l2_dir, first):
    srv = server_factory(*l2_flags(l2_dir, 256 << 20, "--io-threads", "1"), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        raced = 0
        for rnd in range(8):  # a loaded machine may finish the lookup's reads before the prefetch comes: again
            eng, keys = evicted(client, seed=1 + 10 * rnd)
            before = counters(client)
            pf = P.Prefetch(engine=eng.id, keys=keys)
            lk = P.Lookup(engine=eng.id, request="r", keys=keys, policy="boundary")
            # One socket: the server takes them in this order, the second while the first one's reads run.
            futs = [client.submit(m) for m in ((pf, lk) if first == "prefetch" else (lk, pf))]
            replies = [f.result(timeout=20)[0] for f in futs]
            pre, res = (replies[0], replies[1]) if first == "prefetch" else (replies[1], replies[0])
            assert res.hit_chunks == 5 and pre.hit_chunks == 5
            eng.check(keys, res)
            client.call(P.Release(engine=eng.id, lease=res.lease))
            c = settled(client)
            reads = c["l2_prefetches"] - before["l2_prefetches"]
            assert reads == RESUME_5, "one read per object"
            assert pre.in_l1 + pre.loading + pre.started + pre.waiting == RESUME_5
            if first == "lookup":
                assert pre.started == 0, "the lookup's reads were started: none started twice"
            assert c["l2_prefetch_failures"] == 0 and c["l1_pinned_objects"] == 0
            lookup_checked(eng, keys, 5, policy="boundary")
            raced += first == "prefetch" or pre.loading > 0
            if raced:
                break
        assert raced, "the prefetch never came while the lookup's reads were in flight: the race was not tested"


@pytest.mark.parametrize("held", ["pinned", "reserved"])
def test_prefetch_into_an_l1_full_of_held_objects_refuses_and_evicts_none(server_factory, l2_dir, held):
    srv = server_factory(*l2_flags(l2_dir), l1_gib=TINY_L1)
    with CacheClient(srv.endpoint, timeout_s=20) as client:
        eng, keys = evicted(client)
        holder = Engine(client, salt="holder")
        hkeys = holder.keys(13, seed=50)
        lease = 0
        if held == "reserved":
            prep, _ = client.call(P.PrepareStore(engine=holder.id, request="h", keys=hkeys,
                                                 objects=[(c, 0) for c in range(13)] + [(c, 1) for c in range(13)]
                                                 + [(c, 2) for c in range(13)] + [(c, 3) for c in range(13)]))
            assert prep.refused, "the reservation was meant to take all of L1"
        else:
            hkeys = hkeys[:12]  # 48 objects of the 51 L1 slots, all pinned by one lease
            holder.store(hkeys, request="h")
            settled(client)
            res = holder.lookup(hkeys, policy="all", request="h")
            lease = res.lease
            assert res.hit_chunks == 12 and counters(client)["l1_pinned_objects"] == 48
            holder.check(hkeys, res)
        before = counters(client)
        r = prefetch(eng, keys)
        # Reserved slots count as unready, so wait for the reads only where nothing is reserved.
        c = settled(client) if held == "pinned" else counters(client)
        refused = c["prefetch_objects_refused"] - before["prefetch_objects_refused"]
        started = c["prefetch_objects_started"] - before["prefetch_objects_started"]
        assert r.hit_chunks == 5 and c["parked"] == 0 and started + refused == RESUME_5
        if held == "reserved":  # nothing at all is evictable: refused at once
            assert (r.refused, r.started, r.waiting) == (RESUME_5, 0, 0)
        else:  # 48 of 51 slots pinned: at most the 3 others take reads
            assert refused >= RESUME_5 - 3
        assert c["l1_pinned_objects"] == before["l1_pinned_objects"]
        assert client.call(P.Health())[0].status == "ok"
        if held == "pinned":
            holder.check(hkeys, res)  # the pinned bytes are untouched
            client.call(P.Release(engine=holder.id, lease=lease))
        else:
            client.call(P.AbortStore(engine=holder.id, reservation=prep.reservation))
        r = prefetch(eng, keys)  # room again
        assert r.refused == 0 and r.started + r.waiting + r.in_l1 == RESUME_5
        settled(client)
        lookup_checked(eng, keys, 5, policy="boundary")


def test_kvtransfer_prefetch_returns_a_future_and_the_retrieve_after_it_is_exact(server_factory, l2_dir):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from hybridkv.engine.transfer import KVTransfer
    from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

    srv = server_factory(*l2_flags(l2_dir), "--max-keys", "6", l1_gib=TINY_L1)
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, 64, "cpu")
    fill_random(pools, 7)
    alloc = BlockAllocator(64)
    with CacheClient(srv.endpoint, timeout_s=20) as client, KVTransfer(srv.endpoint, layout, pools) as kv:
        ct = kv.chunk_tokens
        bpc = [ct // g.block_tokens for g in layout.groups]
        tokens = np.random.default_rng(7).integers(0, 150_000, 5 * ct + 3)
        src = [alloc.allocate(5 * b + 1) for b in bpc]
        kv.store("a", tokens, src).wait_committed(20)
        kv.end_session("a")
        fill(Engine(client, salt="filler"), 16, seed=8)  # pushes the 5 chunks out to L2
        settled(client)
        assert kv.prefetch(tokens[:ct - 1]).result(timeout=5).hit_chunks == 0  # no full chunk: no request
        r = kv.prefetch(tokens).result(timeout=20)
        assert r.hit_chunks == 5 and r.started + r.waiting == RESUME_5
        c = settled(client)
        hit = kv.lookup("b", tokens)
        assert hit.hit_chunks == 5
        assert counters(client)["lookup_l2_waits"] == c["lookup_l2_waits"], "the lookup found it all in L1"
        dst = [alloc.allocate(5 * b + 1) for b in bpc]
        kv.retrieve(hit, dst).wait(20)
        for g, grp in enumerate(layout.groups):
            moved = range(5 * bpc[g]) if grp.kind == "attention" else [5 * bpc[g] - 1]
            for t in pools[g]:
                assert all(torch.equal(t[src[g][j]], t[dst[g][j]]) for j in moved), g
        kv.end_session("b")
        with pytest.raises(ServerError) as e:  # an error arrives through the future, never raised at the call
            kv.prefetch(np.concatenate([tokens, tokens[:2 * ct]])).result(timeout=20)
        assert e.value.code == P.ErrorCode.LIMIT
