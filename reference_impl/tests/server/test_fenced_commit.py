"""Fenced commits against a real server process: a store's commit sent with its copies, published once the
reservation's fence word in the arena holds its id (hybridkv.server.books.fences). Here the test's own process
writes the slots and the fence word into the shared arena, as an engine's GPU copies do on CUDA."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.wire import protocol as P
from serverkit import Engine, counters

L1_BYTES = int(0.05 * 2**30)


@pytest.fixture
def eng(server):
    """An engine registered by hand on its own client (`serverkit.Engine`: it maps the arena)."""
    with CacheClient(server.endpoint, timeout_s=10) as c:
        yield Engine(c)



def prepare(eng: Engine, keys: list[bytes], request: str = "r") -> P.Prepared:
    prep, _ = eng.client.call(P.PrepareStore(engine=eng.id, request=request, keys=keys,
                                             objects=[(c, g) for c in range(len(keys))
                                                      for g in range(len(eng.layout.groups))]))
    return prep


def write_slots(eng: Engine, keys: list[bytes], prep: P.Prepared) -> None:
    for s in prep.slots:
        eng.arena[s.offset:s.offset + s.length] = Engine.payload(keys[s.chunk], s.group, s.length)


def write_fence(eng: Engine, prep: P.Prepared, value: int | None = None) -> None:
    eng.arena[prep.fence:prep.fence + 8] = np.frombuffer(
        int(prep.reservation if value is None else value).to_bytes(8, "little", signed=True), np.uint8)


def fenced(eng: Engine, prep: P.Prepared):
    return eng.client.submit(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="shm", fenced=True))


def test_every_reservation_gets_a_zeroed_fence_word_above_the_slots(eng):
    preps = [prepare(eng, eng.keys(2, seed=i), request=f"r{i}") for i in range(3)]
    offsets = [p.fence for p in preps]
    assert len(set(offsets)) == 3 and all(o >= L1_BYTES and o % 8 == 0 for o in offsets), offsets
    assert all(o + 8 <= eng.reg.arena_bytes for o in offsets)
    assert all(not eng.arena[o:o + 8].any() for o in offsets)
    # nothing to reserve (every object present): no reservation, no fence word
    keys = eng.keys(1, seed=9)
    eng.store(keys)
    again = prepare(eng, keys)
    assert again.reservation == 0 and again.fence == 0


def test_a_fenced_commit_publishes_only_once_its_word_shows_and_others_are_served_meanwhile(server):
    with CacheClient(server.endpoint, timeout_s=10) as c, CacheClient(server.endpoint, timeout_s=10) as other:
        eng = Engine(c)
        keys = eng.keys(3, seed=1)
        prep = prepare(eng, keys)
        commit = fenced(eng, prep)  # sent before any byte is written: the copies "run" after it
        time.sleep(0.2)
        assert not commit.done()
        probe = Engine(other)
        assert probe.lookup(keys).hit_chunks == 0  # another namespace: but the same engine must miss too
        assert eng.lookup(keys, request="peek").hit_chunks == 0, "published before its fence showed"
        c.call(P.EndSession(engine=eng.id, request="peek"))
        write_slots(eng, keys, prep)
        write_fence(eng, prep, value=prep.reservation ^ 1)  # a word that is not its id publishes nothing
        time.sleep(0.1)
        assert not commit.done()
        write_fence(eng, prep)
        reply, _ = commit.result(5)
        assert isinstance(reply, P.Committed) and reply.objects == len(prep.slots)
        res = eng.lookup(keys, policy="all", request="after")
        assert res.hit_chunks == 3
        eng.check(keys, res)
        st = counters(c)
        assert st["commits_fenced"] == 1 and st["fence_timeouts"] == 0


def test_a_fence_that_shows_before_the_commit_arrives_publishes_at_once(eng):
    keys = eng.keys(2, seed=2)
    prep = prepare(eng, keys)
    write_slots(eng, keys, prep)
    write_fence(eng, prep)
    reply, _ = fenced(eng, prep).result(5)
    assert isinstance(reply, P.Committed)
    assert eng.lookup(keys, policy="all").hit_chunks == 2


def test_a_fence_that_never_shows_fails_its_commit_after_the_client_timeout(server_factory):
    srv = server_factory(client_timeout=1.5)
    with CacheClient(srv.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        c.keepalive(eng.id, 0.3)  # the engine stays alive: only its fence is late
        keys = eng.keys(2, seed=3)
        prep = prepare(eng, keys)
        write_slots(eng, keys, prep)
        commit = fenced(eng, prep)
        with pytest.raises(ServerError) as ei:
            commit.result(8)
        assert ei.value.code == "bad_payload" and "did not show" in str(ei.value)
        assert eng.lookup(keys).hit_chunks == 0
        st = counters(c)
        assert st["fence_timeouts"] == 1 and st["commits_fenced"] == 0 and st["objects_aborted"] == len(prep.slots)
        write_fence(eng, prep)  # a fence landing late publishes nothing
        time.sleep(0.1)
        assert eng.lookup(keys, request="late").hit_chunks == 0


def test_abort_unregister_and_a_second_commit_end_a_waiting_fenced_commit(eng):
    c = eng.client
    keys = eng.keys(2, seed=4)
    prep = prepare(eng, keys)
    commit = fenced(eng, prep)
    time.sleep(0.05)
    with pytest.raises(ServerError) as twice:  # one commit per reservation
        c.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="shm", fenced=True))
    assert twice.value.code == "unknown_reservation"
    done, _ = c.call(P.AbortStore(engine=eng.id, reservation=prep.reservation))
    assert done.count == len(prep.slots)
    with pytest.raises(ServerError) as ei:
        commit.result(5)
    assert ei.value.code == "unknown_reservation" and "aborted" in str(ei.value)
    write_fence(eng, prep)
    time.sleep(0.05)
    assert eng.lookup(keys).hit_chunks == 0

    keys2 = eng.keys(2, seed=5)
    prep2 = prepare(eng, keys2, request="u")
    commit2 = fenced(eng, prep2)
    time.sleep(0.05)
    c.call(P.Unregister(engine=eng.id))
    with pytest.raises(ServerError) as ei2:
        commit2.result(5)
    assert ei2.value.code == "unknown_engine"
    st = counters(c)
    assert st["reservations"] == 0 and st["commits_fenced"] == 0


def test_a_fenced_commit_is_refused_for_a_payload_format_and_a_reservation_without_a_word(eng):
    c = eng.client
    keys = eng.keys(1, seed=6)
    prep = prepare(eng, keys)
    with pytest.raises(ServerError) as ei:
        c.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw", fenced=True))
    assert ei.value.code == "bad_request" and "shm" in str(ei.value)
    # refused, not consumed: the reservation commits the classic way
    write_slots(eng, keys, prep)
    c.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
    assert eng.lookup(keys, policy="all").hit_chunks == 1


def test_a_stale_word_of_an_earlier_reservation_never_publishes_a_later_one(eng):
    """Words are reused oldest-freed first and zeroed when handed out; a late write of an aborted
    reservation's id into a word now another's does not publish it."""
    c = eng.client
    first = prepare(eng, eng.keys(1, seed=7), request="a")
    c.call(P.AbortStore(engine=eng.id, reservation=first.reservation))
    later = [prepare(eng, eng.keys(1, seed=100 + i), request=f"b{i}") for i in range(40)]
    assert first.fence not in [p.fence for p in later]  # oldest-freed first: not the word just freed
    victim = later[0]
    keys = eng.keys(1, seed=100)
    write_slots(eng, keys, victim)
    commit = fenced(eng, victim)
    write_fence(eng, victim, value=first.reservation)
    time.sleep(0.1)
    assert not commit.done()
    write_fence(eng, victim)
    assert isinstance(commit.result(5)[0], P.Committed)


def test_shutdown_answers_a_waiting_fenced_commit(server_factory):
    srv = server_factory()
    with CacheClient(srv.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        prep = prepare(eng, eng.keys(1, seed=8))
        commit = fenced(eng, prep)
        time.sleep(0.05)
        t = time.monotonic()
        srv.stop()  # SIGTERM: a clean shutdown
        with pytest.raises(ServerError) as ei:
            commit.result(5)
        assert ei.value.code == "shutting_down" and time.monotonic() - t < 5


def test_fence_words_run_out_then_come_back_oldest_freed_first(tmp_path):
    """The pool itself, over a real arena file: a word per take until none is left (0: the classic commit),
    words given back are handed out again in the order they came back, each zeroed."""
    from hybridkv.memory.arena import Arena
    from hybridkv.server.books.fences import FENCE_WORD, Fences, fence_region_bytes

    arena = Arena(1 << 20, tmp_path, fence_bytes=fence_region_bytes(1 << 20))
    try:
        f = Fences(arena)
        n = len(f.words)
        assert n == fence_region_bytes(1 << 20) // FENCE_WORD and arena.fence_base >= 1 << 20
        got = [f.take() for _ in range(n)]
        assert len(set(got)) == n and all(g >= arena.fence_base for g in got) and f.take() == 0
        f.words[:] = 12345
        f.give_back(got[7])
        f.give_back(got[3])
        assert f.take() == got[7] and f.words[7] == 0 and f.take() == got[3] and f.take() == 0
        with pytest.raises(ValueError):
            f.word(arena.fence_base + 3)
    finally:
        arena.close()


def test_many_pending_fences_publish_each_on_its_own_word(server):
    """200 fenced commits waiting at once, their words written in a shuffled order: each publishes exactly
    its own reservation, none another's."""
    with CacheClient(server.endpoint, timeout_s=20) as c:
        eng = Engine(c)
        keys = [eng.keys(1, seed=1000 + i) for i in range(200)]
        preps = [prepare(eng, k, request=f"m{i}") for i, k in enumerate(keys)]
        commits = [fenced(eng, p) for p in preps]
        order = np.random.default_rng(0).permutation(200)
        for i in order[:100]:
            write_slots(eng, keys[i], preps[i])
            write_fence(eng, preps[i])
        for i in order[:100]:
            assert isinstance(commits[i].result(5)[0], P.Committed)
        assert not any(commits[i].done() for i in order[100:])
        for i in order[100:]:
            write_slots(eng, keys[i], preps[i])
            write_fence(eng, preps[i])
        assert all(isinstance(f.result(5)[0], P.Committed) for f in commits)
        for i, k in enumerate(keys):
            res = eng.lookup(k, policy="all", request=f"l{i}")
            assert res.hit_chunks == 1
            eng.check(k, res)
        assert counters(c)["commits_fenced"] == 200
