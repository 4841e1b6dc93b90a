"""The cache server end to end: real server processes, real shared memory, real sockets."""

from __future__ import annotations

import numpy as np
import pytest
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from serverkit import ATTN, STATES, Engine, module_server


@pytest.fixture(scope="module")
def server():
    """One server for the module (the `client` fixture's too): these tests check requests, not a server's start.
    Each test's engines register under its own salt, so the keys it stores are no other test's."""
    with module_server() as s:
        yield s


@pytest.fixture
def salt(request) -> str:
    return request.node.name


def counters_now(client: CacheClient) -> dict:
    return client.call(P.Stats())[0].counters


def test_store_lookup_retrieve_shm_round_trip(client, salt):
    eng = Engine(client, salt=salt)
    assert len(eng.layout.groups) == 4 and eng.sizes[0] == eng.layout.object_bytes(0, eng.chunk_tokens)
    keys = eng.keys(5)
    prep = eng.store(keys)
    assert len(prep.slots) == 5 * 4 and not prep.present and not prep.refused
    res = eng.lookup(keys, policy="all")
    assert res.hit_chunks == 5 and len(res.objects) == 20
    eng.check(keys, res)
    client.call(P.Release(engine=eng.id, lease=res.lease))


def test_raw_retrieve_sends_the_same_bytes(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(3)
    eng.store(keys)
    res = eng.lookup(keys)
    rep, frames = client.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw"))
    assert [(o.chunk, o.group) for o in rep.objects] == [(o.chunk, o.group) for o in res.objects]
    for o, f in zip(rep.objects, frames, strict=True):
        assert np.array_equal(np.frombuffer(f, np.uint8), eng.payload(keys[o.chunk], o.group, o.length))


def test_raw_store_copies_frames_into_the_arena(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(2)
    objs = [(c, g) for c in range(2) for g in range(4)]
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=objs))
    frames = [eng.payload(keys[s.chunk], s.group, s.length) for s in prep.slots]
    done, _ = client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), frames)
    assert done.objects == 8 and done.bytes == sum(eng.sizes) * 2
    eng.check(keys, eng.lookup(keys, policy="all"))


@pytest.mark.parametrize("fmt", ["pickle", "torch_save"])
def test_legacy_formats_round_trip(client, fmt, salt):
    torch = pytest.importorskip("torch")
    from hybridkv.baselines.codec import decode_tensor, encode_tensor

    eng = Engine(client, salt=salt)
    keys = eng.keys(2)
    objs = [(c, g) for c in range(2) for g in range(4)]
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=objs))
    frames = []
    for s in prep.slots:
        t = torch.from_numpy(eng.payload(keys[s.chunk], s.group, s.length).copy())
        frames.append(encode_tensor(fmt, t.view(getattr(torch, eng.layout.groups[s.group].dtype))))
    client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format=fmt), frames)
    res = eng.lookup(keys, policy="all")
    eng.check(keys, res)
    rep, out = client.call(P.Retrieve(engine=eng.id, lease=res.lease, format=fmt))
    for o, f in zip(rep.objects, out, strict=True):
        t = decode_tensor(fmt, f)
        assert t.dtype == getattr(torch, eng.layout.groups[o.group].dtype)
        assert np.array_equal(t.view(torch.uint8).numpy(), eng.payload(keys[o.chunk], o.group, o.length))


def test_store_is_delta_aware(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(4)
    eng.store(keys[:2])
    prep = eng.store(keys)
    assert sorted(prep.present) == [(c, g) for c in range(2) for g in range(4)]
    assert len(prep.slots) == 8


def test_hit_needs_the_recurrent_state_at_the_last_chunk(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(6)
    attn = [(c, ATTN) for c in range(6)]
    # states of all three recurrent groups only at chunk 2; one group's state at chunk 4
    eng.store(keys, attn + [(2, g) for g in STATES] + [(4, STATES[0])])
    res = eng.lookup(keys)
    assert res.hit_chunks == 3, "a prefix whose state is missing must not be reported as a hit"
    assert sorted((o.chunk, o.group) for o in res.objects) == sorted(
        [(0, ATTN), (1, ATTN), (2, ATTN)] + [(2, g) for g in STATES])
    eng.check(keys, res)
    # 'all' needs every group at every chunk: nothing before chunk 0 has states
    assert eng.lookup(keys, policy="all", request="q").hit_chunks == 0


def test_hit_stops_at_a_missing_attention_chunk(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(5)
    eng.store(keys, [(c, ATTN) for c in (0, 1, 3, 4)] + [(c, g) for c in range(5) for g in STATES])
    assert eng.lookup(keys).hit_chunks == 2


def test_skip_chunks_returns_only_the_objects_the_engine_lacks(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(4)
    eng.store(keys)
    res = eng.lookup(keys, skip=3)
    assert res.hit_chunks == 4
    assert sorted((o.chunk, o.group) for o in res.objects) == [(3, 0), (3, 1), (3, 2), (3, 3)]


def test_namespaces_separate_ranks_salts_and_models(client, salt):
    a = Engine(client, salt=salt)
    keys = a.keys(2)
    a.store(keys)
    b = Engine(client, layout=preset_layout("tiny-hybrid", tp=2), tp_rank=1, salt=salt)
    c = Engine(client, salt=f"{salt}/tenant-b")
    assert len({a.reg.namespace, b.reg.namespace, c.reg.namespace}) == 3
    assert b.lookup(b.keys(2)).hit_chunks == 0 and c.lookup(c.keys(2)).hit_chunks == 0
    # a second engine of the same model and rank shares the first one's cache
    d = Engine(client, salt=salt)
    assert d.reg.namespace == a.reg.namespace and d.lookup(keys).hit_chunks == 2


def test_pinned_objects_are_never_evicted_and_stores_are_refused_with_a_reason(server_factory):
    srv = server_factory(l1_gib=0.001)  # ~1 MiB: 12 tiny-hybrid objects of 40 KiB... a few chunks
    with CacheClient(srv.endpoint, timeout_s=10) as client:
        eng = Engine(client)
        per_chunk = sum(-(-s // 4096) * 4096 for s in eng.sizes)
        fit = (1 << 30) // 1000 // per_chunk
        keys = eng.keys(fit + 3)
        eng.store(keys[:fit])
        res = eng.lookup(keys[:fit], policy="all")  # pins everything stored
        assert res.hit_chunks == fit
        prep = eng.store(keys[fit:])
        assert prep.refused and all("no space" in r.reason for r in prep.refused)
        eng.check(keys, res)  # nothing pinned was disturbed
        client.call(P.Release(engine=eng.id, lease=res.lease))
        prep = eng.store(keys[fit:], request="r2")
        assert not prep.refused, "once unpinned, old objects are evicted to make room"
        stats, _ = client.call(P.Stats())
        assert stats.counters["l1_evictions"] > 0


def test_end_session_releases_pins_and_aborts_reservations(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(3)
    before = counters_now(client)  # other tests' leases may still pin objects of theirs
    eng.store(keys)
    eng.lookup(keys, request="a")
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="a", keys=eng.keys(1, seed=9), objects=[(0, 0)]))
    done, _ = client.call(P.EndSession(engine=eng.id, request="a"))
    assert done.count == 2
    now = counters_now(client)
    assert now["l1_pinned_objects"] == before["l1_pinned_objects"] and now["reservations"] == before["reservations"]
    with pytest.raises(ServerError, match="unknown_reservation"):
        client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))


def test_abort_makes_nothing_visible(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(2)
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys,
                                         objects=[(c, g) for c in range(2) for g in range(4)]))
    client.call(P.AbortStore(engine=eng.id, reservation=prep.reservation))
    assert eng.lookup(keys).hit_chunks == 0
    assert len(eng.store(keys).slots) == 8


def test_uncommitted_objects_are_invisible(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(1)
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=[(0, g) for g in range(4)]))
    assert eng.lookup(keys).hit_chunks == 0
    client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
    assert eng.lookup(keys).hit_chunks == 1


def test_stats_clear_health_unregister(client, salt):
    eng = Engine(client, salt=salt)
    keys = eng.keys(2)
    before = counters_now(client)
    eng.store(keys)
    now = counters_now(client)
    assert now["objects_committed"] - before["objects_committed"] == 8
    assert now["l1_objects"] - before["l1_objects"] == 8
    done, _ = client.call(P.Clear(engine=eng.id))
    assert done.count == 8 and eng.lookup(keys).hit_chunks == 0
    health, _ = client.call(P.Health())
    assert health.status == "ok" and health.pid > 0
    client.call(P.Unregister(engine=eng.id))
    with pytest.raises(ServerError, match="unknown_engine"):
        eng.lookup(keys)


def test_every_request_type_has_a_handler():
    """The loop finds handlers by the decoded message's type: a request type added to the protocol without
    one would be answered bad_message by every server."""
    from typing import get_args

    from hybridkv.server.front.loop import HANDLERS

    assert set(HANDLERS) == set(get_args(P.Request))


def test_many_engines_interleaved(server, salt):
    """TP ranks of one model and another model, each from its own client, requests interleaved."""
    import threading

    errors = []

    def worker(rank: int, tp: int, model: str):
        try:
            with CacheClient(server.endpoint, timeout_s=20) as c:
                eng = Engine(c, layout=preset_layout(model, tp=tp), tp_rank=rank, salt=salt)
                for i in range(5):
                    keys = eng.keys(3, seed=100 * rank + i)
                    eng.store(keys, request=f"q{i}")
                    res = eng.lookup(keys, policy="all", request=f"q{i}")
                    assert res.hit_chunks == 3
                    eng.check(keys, res)
                    c.call(P.EndSession(engine=eng.id, request=f"q{i}"))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r, 2, "tiny-hybrid")) for r in range(2)]
    threads.append(threading.Thread(target=worker, args=(0, 1, "tiny-hybrid")))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
