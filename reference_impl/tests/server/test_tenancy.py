"""Tenants inside one server: a client that sends another namespace's chunk keys under its own registration.

Keys hash the namespace in (hybridkv.model.keys), so an honest engine never names another namespace's key; a hostile
one that learned some (a log, a shared prompt's keys seen once) sends them as its own. Every object carries the
namespace it was stored under, and the server answers such a key as a miss (lookup, probe, prefetch) or refuses
it (prepare), counting the request in `namespace_refusals`; it never hands out the other namespace's bytes, and
never lets the other namespace's objects stand in for the asker's own. Real server processes, two clients.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hybridkv.engine.client import CacheClient
from hybridkv.server.l2.base import L2Error
from hybridkv.wire import protocol as P
from serverkit import Engine, counters, settled

MIB = 1 << 20
TINY_L1 = 1 / 1024  # 1 MiB: 51 tiny-hybrid objects, under 13 chunks



def every_object(eng: Engine, n: int) -> list[tuple[int, int]]:
    return [(c, g) for c in range(n) for g in range(len(eng.sizes))]


def raw_bytes(eng: Engine, lease: int) -> list[np.ndarray]:
    rep, frames = eng.client.call(P.Retrieve(engine=eng.id, lease=lease, format="raw"))
    return [np.frombuffer(f, np.uint8) for f in frames]


def no_bytes_of(victim_keys: list[bytes], thief: Engine) -> None:
    """Every way `thief` (another namespace, its own connection) can ask for `victim_keys` gets nothing."""
    c = thief.client
    res = thief.lookup(victim_keys, policy="all")
    if res.lease:  # what the hostile review did: retrieve the lease over raw and read the other tenant's bytes
        got = raw_bytes(thief, res.lease)
        stolen = sum(np.array_equal(g, Engine.payload(victim_keys[o.chunk], o.group, o.length))
                     for o, g in zip(res.objects, got, strict=True))
        raise AssertionError(f"a lookup of another namespace's keys hit {res.hit_chunks} chunks and a raw retrieve "
                             f"handed out {stolen} of its {len(res.objects)} objects' bytes")
    assert res.hit_chunks == 0 and res.objects == []
    assert c.call(P.Lookup(engine=thief.id, request="probe", keys=victim_keys, pin=False))[0].hit_chunks == 0
    pre = c.call(P.Prefetch(engine=thief.id, keys=victim_keys, policy="all"))[0]
    assert (pre.hit_chunks, pre.in_l1, pre.started, pre.loading) == (0, 0, 0, 0), pre


def test_another_namespace_s_keys_are_a_miss_under_one_s_own_registration(server_factory):
    s = server_factory()
    with CacheClient(s.endpoint, timeout_s=10) as ca, CacheClient(s.endpoint, timeout_s=10) as cb:
        a, b = Engine(ca, salt="tenant-a"), Engine(cb, salt="tenant-b")
        assert a.reg.namespace != b.reg.namespace
        keys = a.keys(4, seed=1)
        a.store(keys)
        no_bytes_of(keys, b)
        assert counters(ca)["namespace_refusals"] == 3  # the lookup, the probe, the prefetch
        # a prepare of them: refused (never "present", which would let the other's objects stand in for b's)
        prep = b.store(keys)
        assert prep.reservation == 0 and prep.present == [] and len(prep.refused) == 16
        assert all("another namespace" in r.reason for r in prep.refused), prep.refused[0]
        assert counters(ca)["namespace_refusals"] == 4
        # the owner is untouched: a full hit with its own bytes
        res = a.lookup(keys, policy="all")
        assert res.hit_chunks == 4
        for o, got in zip(res.objects, raw_bytes(a, res.lease), strict=True):
            assert np.array_equal(got, Engine.payload(keys[o.chunk], o.group, o.length))
        # and b's own keys behave as ever (no refusal counted for them)
        mine = b.keys(3, seed=2)
        b.store(mine)
        hit = b.lookup(mine, policy="all")
        assert hit.hit_chunks == 3
        b.check(mine, hit)
        assert counters(ca)["namespace_refusals"] == 4


def test_objects_stored_under_another_namespace_s_keys_never_stand_in_for_its_own(server_factory):
    """The other way round: b stores its bytes under a's keys before a does. a's lookup must not serve them."""
    s = server_factory()
    with CacheClient(s.endpoint, timeout_s=10) as ca, CacheClient(s.endpoint, timeout_s=10) as cb:
        a, b = Engine(ca, salt="tenant-a"), Engine(cb, salt="tenant-b")
        keys = a.keys(4, seed=3)
        prep, _ = cb.call(P.PrepareStore(engine=b.id, request="r", keys=keys, objects=every_object(b, 4)))
        assert len(prep.slots) == 16  # nobody held them: b may store whatever it likes under any key, as its own
        cb.call(P.CommitStore(engine=b.id, reservation=prep.reservation, format="raw"),
                [np.full(o.length, 0xEE, np.uint8).tobytes() for o in prep.slots])
        res = a.lookup(keys, policy="all")
        assert res.hit_chunks == 0 and res.lease == 0, "b's bytes were served to a as a's own"
        prep = a.store(keys)
        assert prep.present == [] and len(prep.refused) == 16, prep  # never "present": a would skip its store
        assert b.lookup(keys, policy="all").hit_chunks == 4  # b's objects are b's (under b's namespace)


def fill(eng: Engine, n_chunks: int, seed: int) -> None:
    """Store fresh chunks four at a time, so older objects leave L1 for L2."""
    keys = eng.keys(n_chunks, seed=seed)
    for i in range(0, n_chunks, 4):
        assert not eng.store(keys[i:i + 4], request=f"fill{seed}-{i}").refused


def test_an_object_read_back_from_l2_is_checked_against_the_asker_s_namespace(server_factory, tmp_path: Path):
    l2 = tmp_path / "l2"
    s = server_factory("--l2-dir", str(l2), "--l2-gib", f"{256 * MIB / (1 << 30):.6f}", l1_gib=TINY_L1)
    with CacheClient(s.endpoint, timeout_s=20) as ca, CacheClient(s.endpoint, timeout_s=20) as cb:
        a, b = Engine(ca, salt="tenant-a"), Engine(cb, salt="tenant-b")
        keys = a.keys(4, seed=5)
        a.store(keys)
        fill(a, 24, seed=6)  # a's first objects are in L2 only now
        assert settled(ca)["l2_spills"] >= 16  # (once the spills the stores started have ended)
        assert all((l2 / k.hex()[:2] / f"{k.hex()}-{g}.obj").exists() for k in keys for g in range(4))
        assert counters(ca)["l1_objects"] < 16 * 7
        before = counters(ca)["l2_prefetches"]
        no_bytes_of(keys, b)
        after = counters(ca)
        assert after["l2_prefetches"] == before, "b's requests read a's objects back from L2"
        assert after["namespace_refusals"] == 3
        prep = b.store(keys)  # L2 holds them under a's namespace: refused, not reserved over a's copy
        assert prep.reservation == 0 and prep.present == [] and len(prep.refused) == 16
        res = a.lookup(keys, policy="all")  # a's own come back from L2, byte for byte
        assert res.hit_chunks == 4
        a.check(keys, res)


# ---- the L2 adapters themselves ----------------------------------------------------------------------

NS_A, NS_B = b"namespace-a-0001", b"namespace-b-0002"


@pytest.fixture(params=["fs", "redis"])
def two_adapters(request, tmp_path):
    """Two adapters on one store: one directory opened twice in turn (fs), or two servers' adapters on one
    redis-server (a shared L2, as two hosts see it)."""
    if request.param == "fs":
        from hybridkv.server.l2.fs import FilesystemL2

        l2 = FilesystemL2(tmp_path / "l2", 64 * MIB)
        yield l2, l2
        l2.close()
        return
    import rediskit

    if rediskit.skip_reason() is not None:
        pytest.skip(str(rediskit.skip_reason()))
    from hybridkv.server.l2.redis import RedisL2
    from hybridkv.server.l2.redis_spec import RedisL2Spec

    store = rediskit.RedisProcess()
    a, b = RedisL2(RedisL2Spec(url=store.url)), RedisL2(RedisL2Spec(url=store.url))
    yield a, b
    a.close()
    b.close()
    store.close()


def test_an_l2_object_is_served_to_its_own_namespace_only_and_never_replaced_by_another(two_adapters):
    mine, theirs = two_adapters
    key, data = bytes(range(16)), bytes(range(256)) * 40
    mine.put(key, 2, NS_A, data)
    assert theirs.length(key, 2, NS_B) is None and theirs.length(key, 2) == len(data)
    out = bytearray(len(data))
    assert not theirs.get_into(key, 2, memoryview(out), NS_B) and out == bytearray(len(data))
    with pytest.raises(L2Error, match="another namespace"):
        theirs.put(key, 2, NS_B, b"\xee" * len(data))
    assert mine.length(key, 2, NS_A) == len(data)  # kept, not removed as damaged, not overwritten
    assert mine.get_into(key, 2, memoryview(out), NS_A) and bytes(out) == data


def test_tenants_on_separate_servers_share_no_arena_and_no_objects(server_factory):
    a_srv, b_srv = server_factory(name="tenant-a"), server_factory(name="tenant-b")
    with CacheClient(a_srv.endpoint, timeout_s=10) as ca, CacheClient(b_srv.endpoint, timeout_s=10) as cb:
        a, b = Engine(ca), Engine(cb)
        assert a.reg.arena_path != b.reg.arena_path
        for reg in (a.reg, b.reg):
            st = os.stat(reg.arena_path)
            assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        keys = a.keys(3, seed=10)
        a.store(keys)
        assert b.lookup(keys).hit_chunks == 0  # the same tokens and layout: nothing of a's is visible
        hit = a.lookup(keys)
        o = hit.objects[0]
        payload = Engine.payload(keys[o.chunk], o.group, o.length)
        assert np.array_equal(a.arena[o.offset:o.offset + o.length], payload)
        assert not np.array_equal(b.arena[o.offset:o.offset + o.length], payload)
