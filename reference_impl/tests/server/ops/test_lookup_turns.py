"""Large Lookups and Prefetches work in turns (issue 23: no client delays another client's request by more than
50 ms), on real server processes and real ZMQ clients; so do a large PrepareStore's answer, a large CommitStore's
publication and the letting go of a large lease's pins after its Release, EndSession or Unregister.

A large one (more than turns.BIG_OBJECTS keys x groups) answers what the one-turn path answers for the same state
(compared with a server that takes the one-turn path for every size, `turns_serve.py --one-turn`); another
client's requests are answered between its turns; its engine going away mid-lookup (unregister, reclaim), its
session ending, objects evicted, replaced under another namespace or stored between its turns leave no pin behind
and no object in its answer that is not the engine's own and still there. Servers started by `turns_serve.py
--turn-s 0 --slice N` take thousands of turns per request, so that a request sent while one works surely lands
between two of its turns.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import turns_serve
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.model.policy import resume_objects
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import ServerProcess
from hybridkv.wire import protocol as P
from hybridkv_bench.microbench.lookup_bench import store_chunks
from serverkit import Engine

CT = 2  # chunk tokens
MIXED = ModelLayout(model="turns", groups=(
    GroupLayout(kind="attention", layer_names=("a",), page_bytes=2, block_tokens=1),
    GroupLayout(kind="recurrent", layer_names=("r",), page_bytes=2, block_tokens=1),
    GroupLayout(kind="sliding", layer_names=("s",), page_bytes=2, block_tokens=1, window=9),
    GroupLayout(kind="attention", layer_names=("b",), page_bytes=2, block_tokens=1),
))
COUNTED = ("hit_chunks", "probe_hit_chunks", "hit_chunks_l2", "bytes_leased", "lookups", "lookup_l2_waits",
           "namespace_refusals", "prefetch_requests", "prefetch_objects_in_l1", "prefetch_objects_started",
           "prefetch_objects_refused", "errors")


@pytest.fixture
def servers(sock_dir):
    """start(name, *flags, l1_gib=, client_timeout=, **turns) -> a ready turns_serve server; all stopped at the end."""
    procs: list[ServerProcess] = []

    def start(name: str, *flags: str, l1_gib: float = 0.1, client_timeout: float = 30.0, **kw) -> ServerProcess:
        config = parse([f"--endpoint=ipc://{sock_dir}/{name}.sock", f"--l1-gib={l1_gib}",
                        f"--client-timeout={client_timeout}", "--admin", *flags])
        s = turns_serve.start(config, **kw)
        procs.append(s)
        return s

    yield start
    for s in procs:
        s.close()


def stats(client: CacheClient) -> dict:
    return client.call(P.Stats())[0].counters


def settled(client: CacheClient, timeout_s: float = 60.0) -> dict:
    """Counters once nothing is parked and no worker is busy."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = stats(client)
        if c["parked"] == 0 and c["workers_inflight"] == 0 and c["l1_unready_objects"] == 0:
            return c
        assert time.monotonic() < deadline, f"still working after {timeout_s}s: {c}"
        time.sleep(0.01)


def while_working(watcher: CacheClient, fut, timeout_s: float = 60.0) -> None:
    """Returns once the server reports a parked request (the large one, between two of its turns) while `fut`, its
    answer, has not come; fails if the answer comes first."""
    deadline = time.monotonic() + timeout_s
    while stats(watcher)["parked"] < 1:
        assert not fut.done(), "the large request was answered before any other request came between its turns"
        assert time.monotonic() < deadline
    assert not fut.done()


def holes(n: int, kind: str, rng) -> set[tuple[int, int]]:
    """Objects left out of a store of n chunks of MIXED."""
    if kind == "full":
        return set()
    if kind == "attention":  # group b misses a chunk: a hit of at most that chunk
        return {(int(rng.integers(n // 2, n)), 3)}
    if kind == "states":  # no recurrent state on the last 300 chunks: the hit walks down to the last one held
        return {(c, 1) for c in range(n - 300, n)}
    if kind == "sliding":  # a sliding object missing: no length whose window reaches it
        return {(int(rng.integers(n // 2, n)), 2)}
    return {(c, g) for c in range(n) for g in range(4) if rng.random() < 0.0005}  # scattered holes


def comparable(res: P.LookupResult) -> tuple:
    return res.hit_chunks, bool(res.lease), [tuple(o) for o in map(lambda o: (o.chunk, o.group, o.offset, o.length),
                                                                         res.objects)]


# ---- 1. the same answer as one turn --------------------------------------------------------------------------

def test_large_lookups_and_prefetches_answer_what_one_turn_answers(servers):
    """Two servers, one taking the one-turn path for every size and one taking a turn after every 64 objects, go
    through the same stores: every large lookup (pinned or not, both policies, with skip_chunks) and prefetch is
    answered the same, to the objects' places in the arena, and counted the same."""
    ref, big = servers("ref", one_turn=True), servers("big", turn_s=0.0, slice_objects=64)
    rng = np.random.default_rng(3)
    n = 1500  # x 4 groups: 6000 objects, above BIG_OBJECTS
    with CacheClient(ref.endpoint, timeout_s=60) as rc, CacheClient(big.endpoint, timeout_s=60) as bc:
        engines = [Engine(rc, MIXED, chunk_tokens=CT), Engine(bc, MIXED, chunk_tokens=CT)]
        for seed, kind in enumerate(("full", "attention", "states", "sliding", "scattered")):
            keys = engines[0].keys(n, seed=seed)
            leave_out = holes(n, kind, rng)
            objects = [(c, g) for c in range(n) for g in range(4) if (c, g) not in leave_out]
            for e in engines:
                e.store(keys, objects)
            for policy, skip, pin in (("boundary", 0, True), ("all", 0, True), ("boundary", 700, True),
                                      ("boundary", 0, False), ("all", 0, False)):
                msg = P.Lookup(engine=0, request="r", keys=keys, policy=policy, skip_chunks=skip, pin=pin)
                got = []
                for e in engines:
                    msg.engine = e.id
                    res = e.client.call(msg)[0]
                    e.check(keys, res)
                    got.append(res)
                    if res.lease:
                        e.client.call(P.Release(engine=e.id, lease=res.lease))
                assert comparable(got[0]) == comparable(got[1]), (kind, policy, skip, pin)
                if pin:
                    assert [(o.chunk, o.group) for o in got[1].objects] == resume_objects(
                        MIXED, policy, got[1].hit_chunks, skip, CT)
                if kind == "full":
                    assert got[1].hit_chunks == n
            pre = [e.client.call(P.Prefetch(engine=e.id, keys=keys))[0] for e in engines]
            assert pre[0] == pre[1], kind
            assert pre[1].in_l1 == len(resume_objects(MIXED, "boundary", pre[1].hit_chunks, 0, CT))
        counted = [settled(c) for c in (rc, bc)]
    assert {k: counted[0][k] for k in COUNTED} == {k: counted[1][k] for k in COUNTED}
    assert counted[1]["l1_pinned_objects"] == 0 and counted[1]["leases"] == 0


@pytest.mark.slow  # 7 s on the 2-core VM: `nox -s tests_slow` runs it
def test_a_large_prefetch_from_l2_answers_what_one_turn_answers(servers, tmp_path):
    """Every object in L2 and none in L1 (a server's flush on exit, its L2 directory copied for two fresh servers):
    the turned prefetch starts the same reads as the one-turn one, and the lookup after it finds the same objects in
    L1 without waiting."""
    first = servers("first", "--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1", "--flush-on-exit")
    n = 1500
    with CacheClient(first.endpoint, timeout_s=60) as c:
        keys = Engine(c, MIXED, chunk_tokens=CT).keys(n, seed=9)
        Engine(c, MIXED, chunk_tokens=CT).store(keys)
    assert first.stop() == 0
    shutil.copytree(tmp_path / "l2", tmp_path / "l2b")
    ref = servers("ref", "--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1", one_turn=True)
    big = servers("big", "--l2-dir", str(tmp_path / "l2b"), "--l2-gib", "1", turn_s=0.0, slice_objects=64)
    answers = []
    for s in (ref, big):
        with CacheClient(s.endpoint, timeout_s=60) as c:
            e = Engine(c, MIXED, chunk_tokens=CT)
            pre = c.call(P.Prefetch(engine=e.id, keys=keys))[0]
            settled(c)
            res = e.lookup(keys)
            e.check(keys, res)
            c.call(P.Release(engine=e.id, lease=res.lease))
            counted = settled(c)
            answers.append((pre, comparable(res), {k: counted[k] for k in COUNTED}))
            assert counted["l1_pinned_objects"] == 0
    assert answers[0] == answers[1]
    pre = answers[1][0]
    assert pre.hit_chunks == n and pre.in_l1 == 0 and pre.started == len(resume_objects(MIXED, "boundary", n, 0, CT))
    assert answers[1][2]["lookup_l2_waits"] == 0


# ---- 2. other clients are answered between its turns ---------------------------------------------------------

def huge(groups: int = 64, attention: int = 32) -> ModelLayout:
    return ModelLayout(model="huge", groups=tuple(
        GroupLayout(kind="attention" if g < attention else "recurrent", layer_names=(f"l{g}",), page_bytes=2,
                    block_tokens=1) for g in range(groups)))


def huge_stored(client: CacheClient, n: int) -> tuple[int, list[bytes]]:
    """An engine of `huge()` (64 groups, 32 of them attention) with n chunks stored, heartbeating as it stores (a
    test server may reclaim an engine silent for 0.4 s); returns its id and keys."""
    reg = client.call(P.Register(layout=huge(), chunk_tokens=1))[0]
    client.keepalive(reg.engine, 0.1)
    keys = chunk_keys(reg.namespace, np.arange(n), 1)
    for lo in range(0, n, 512):  # a commit publishes its objects in one turn: small ones, so heartbeats get through
        prep = client.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys, objects=[
            (c, g) for c in range(lo, min(n, lo + 512)) for g in range(64)]))[0]
        client.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
    client.forget(reg.engine)
    return reg.engine, keys


def test_another_client_is_answered_between_the_turns_of_a_huge_lookup_and_prefetch(server_factory):
    """A 64-group x 4096-key pinned lookup (131,104 objects leased) and prefetch on a plain `hybridkv serve`: another
    client's Stats, Health and 71-chunk Lookup, sent once the huge request is under way, are answered before it."""
    s = server_factory(l1_gib=1.2)
    n = 4096
    with CacheClient(s.endpoint, timeout_s=120) as big, CacheClient(s.endpoint, timeout_s=120) as other:
        engine, keys = huge_stored(big, n)
        small_engine, small_keys = store_chunks(other)
        small = P.Lookup(engine=small_engine, request="o", keys=small_keys, pin=False)
        lease = 0
        for msg in (P.Lookup(engine=engine, request="r", keys=keys), P.Prefetch(engine=engine, keys=keys)):
            done: dict[str, float] = {}
            t = time.monotonic()
            fut = big.submit(msg)
            fut.add_done_callback(lambda _, done=done: done.setdefault("huge", time.monotonic()))
            while_working(other, fut)
            assert other.call(P.Health())[0].status == "ok"
            assert other.call(small)[0].hit_chunks == 71
            done["other"] = time.monotonic()
            res = fut.result(timeout=120)[0]
            assert done["other"] < done["huge"], f"the other client waited for the whole {type(msg).__name__}"
            print(f"{type(msg).__name__}: the other client's Stats, Health and Lookup answered "
                  f"{1e3 * (done['other'] - t):.1f} ms after the start of one that took {done['huge'] - t:.2f} s")
            if isinstance(res, P.LookupResult):
                assert res.hit_chunks == n and len(res.objects) == 32 * n + 32
                lease = res.lease
            else:
                assert res.hit_chunks == n and res.in_l1 == 32 * n + 32
        big.call(P.Release(engine=engine, lease=lease))
        c = settled(other)
        assert c["l1_pinned_objects"] == 0 and c["leases"] == 0


# ---- 3. its engine gone or its session ended mid-lookup ----------------------------------------------------

BIG_N = 6000  # x 4 groups: 24,000 objects; a turn after every 2, thousands of turns per request


def stored(client: CacheClient, n: int = BIG_N, seed: int = 0) -> tuple[Engine, list[bytes]]:
    """An engine of MIXED with n chunks stored, every group (heartbeats while it stores: a test server may
    reclaim an engine silent for 0.5 s)."""
    eng = Engine(client, MIXED, chunk_tokens=CT)
    client.keepalive(eng.id, 0.1)
    keys = eng.keys(n, seed=seed)
    for lo in range(0, n, 2000):
        eng.store(keys, [(c, g) for c in range(lo, min(n, lo + 2000)) for g in range(4)])
    client.forget(eng.id)
    return eng, keys


def no_pins_left(client: CacheClient) -> dict:
    c = settled(client)
    assert c["l1_pinned_objects"] == 0 and c["leases"] == 0 and c["parked"] == 0, c
    return c


@pytest.mark.parametrize("how", ["unregister", pytest.param("reclaim", marks=pytest.mark.slow)])  # reclaim: 15 s
@pytest.mark.parametrize("request_kind", ["lookup", "prefetch"])
def test_an_engine_gone_mid_request_is_answered_unknown_engine_and_leaves_no_pin(servers, tmp_path, how, request_kind):
    """Unregistered (the Unregister sent right behind it), or silent past --client-timeout and reclaimed, while its
    large lookup or prefetch works (before the prefetch's answer): answered `unknown_engine`, every pin it took let
    go. For the reclaim (0.2 to 0.25 s after
    the engine's last request, its lookup or prefetch) every object is in L2 only, read back by one I/O thread:
    48,000 reads, and the turns before them, take longer than that."""
    if how == "unregister":
        s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=2)
    else:
        l2 = ("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1")
        first = servers("first", *l2, "--flush-on-exit", l1_gib=0.3)
        with CacheClient(first.endpoint, timeout_s=60) as c:
            _, keys = stored(c, 2 * BIG_N)
        assert first.stop() == 0
        s = servers("s", *l2, "--io-threads", "1", l1_gib=0.3, client_timeout=0.2, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        if how == "unregister":
            eng, keys = stored(c)
        else:
            eng = Engine(c, MIXED, chunk_tokens=CT)  # the same namespace: the objects in L2 are its own
        msg = P.Lookup(engine=eng.id, request="r", keys=keys) if request_kind == "lookup" else \
            P.Prefetch(engine=eng.id, keys=keys)
        fut = c.submit(msg)
        if how == "unregister":
            # sent right behind it on the same connection: it arrives while the large request works (one piece a
            # turn on this server: it cannot finish in the turn it arrived in)
            assert isinstance(c.submit(P.Unregister(engine=eng.id)).result(timeout=60)[0], P.Done)
        else:
            while_working(watcher, fut)
        with pytest.raises(ServerError) as err:
            fut.result(timeout=60)
        assert err.value.code == "unknown_engine", err.value
        counted = no_pins_left(watcher)
        assert counted["engines_reclaimed"] == (how == "reclaim")


def test_an_end_session_mid_lookup_answers_after_it_and_releases_its_lease(servers):
    """EndSession(r) sent while a lookup of r works: the lookup answers first with its whole hit, the EndSession
    after it, counting that lookup's lease, now released; a lookup of r sent after the EndSession keeps its lease."""
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, keys = stored(c)
        done: dict[str, float] = {}
        fut = c.submit(P.Lookup(engine=eng.id, request="r", keys=keys))
        fut.add_done_callback(lambda _: done.setdefault("lookup", time.monotonic()))
        end = c.submit(P.EndSession(engine=eng.id, request="r"))  # arrives while the lookup works (as above)
        end.add_done_callback(lambda _: done.setdefault("end", time.monotonic()))
        later = c.submit(P.Lookup(engine=eng.id, request="r", keys=keys[:100]))  # the one-turn path
        later.add_done_callback(lambda _: done.setdefault("later", time.monotonic()))
        after = later.result(timeout=60)[0]
        res = fut.result(timeout=60)[0]
        assert done["later"] < done["lookup"]  # answered between the large lookup's turns
        assert end.result(timeout=60)[0].count == 1
        assert done["lookup"] < done["end"]
        assert res.hit_chunks == BIG_N and res.lease
        with pytest.raises(ServerError) as err:
            c.call(P.Release(engine=eng.id, lease=res.lease))
        assert err.value.code == "unknown_lease"
        assert after.hit_chunks == 100
        eng.check(keys, after)
        assert c.call(P.Release(engine=eng.id, lease=after.lease))[0].count == len(after.objects)
        no_pins_left(watcher)


@pytest.mark.parametrize("how", ["release", "end_session", "unregister"])
def test_a_huge_lease_closed_is_answered_at_once_and_let_go_in_turns(servers, how):
    """Release, EndSession or Unregister of a ~12,000-object lease answers at once (the lease closed in the
    books); its pins are let go in turns after the answer (turns.LetGo: a piece of 1 object a turn here, so
    thousands of turns), another client's requests answered between them; then no pin is left."""
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=1)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, keys = stored(c)
        res = c.call(P.Lookup(engine=eng.id, request="r", keys=keys))[0]
        assert res.hit_chunks == BIG_N and len(res.objects) > 2 * 4096
        msg = {"release": P.Release(engine=eng.id, lease=res.lease),
               "end_session": P.EndSession(engine=eng.id, request="r"),
               "unregister": P.Unregister(engine=eng.id)}[how]
        answer = c.call(msg)[0]
        assert answer.count == {"release": len(res.objects), "end_session": 1, "unregister": 0}[how]
        mid = stats(watcher)  # answered while the pins are let go
        assert mid["leases"] == 0 and mid["parked"] >= 1 and mid["l1_pinned_objects"] > 0, mid
        if how != "unregister":
            with pytest.raises(ServerError) as err:
                c.call(P.Release(engine=eng.id, lease=res.lease))
            assert err.value.code == "unknown_lease"
        no_pins_left(watcher)


@pytest.mark.parametrize("fenced", [False, True])
def test_a_huge_prepare_and_commit_work_in_turns_and_a_lookup_between_sees_whole_objects(servers, fenced):
    """A 24,000-object PrepareStore answers every slot in its order (the answer's locations encoded in turns), and
    its CommitStore (classic, or fenced with the word written before) publishes in turns (turns.PublishOp, one
    object a turn here): another engine's lookup between its turns finds whole objects only (a prefix of the
    commit's), an AbortStore of the reservation meanwhile is `unknown_reservation`, an EndSession of its request
    leaves it, and the commit answers every object, each then found with its bytes."""
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=1)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, reader = Engine(c, MIXED, chunk_tokens=CT), Engine(watcher, MIXED, chunk_tokens=CT)
        keys = eng.keys(BIG_N, seed=5)
        objects = [(ch, g) for ch in range(BIG_N) for g in range(4)]
        prep = c.call(P.PrepareStore(engine=eng.id, request="w", keys=keys, objects=objects))[0]
        assert [(sl.chunk, sl.group) for sl in prep.slots] == objects and prep.reservation
        assert len({sl.offset for sl in prep.slots}) == len(objects)
        for sl in prep.slots:
            eng.arena[sl.offset:sl.offset + sl.length] = eng.payload(keys[sl.chunk], sl.group, sl.length)
        if fenced:
            eng.arena[prep.fence:prep.fence + 8] = np.frombuffer(prep.reservation.to_bytes(8, "little", signed=True),
                                                                 np.uint8)
        fut = c.submit(P.CommitStore(engine=eng.id, reservation=prep.reservation, fenced=fenced))
        while_working(watcher, fut)
        mid = reader.lookup(keys[:1000], request="m")  # the one-turn path, between two of the commit's turns
        reader.check(keys, mid)
        with pytest.raises(ServerError) as err:
            c.call(P.AbortStore(engine=eng.id, reservation=prep.reservation))
        assert err.value.code == "unknown_reservation"
        assert c.call(P.EndSession(engine=eng.id, request="w"))[0].count == 0
        assert not fut.done(), "the commit answered before the requests sent behind it"
        done = fut.result(timeout=60)[0]
        assert isinstance(done, P.Committed) and done.objects == len(objects)
        full = reader.lookup(keys, request="f")
        assert full.hit_chunks == BIG_N
        reader.check(keys, full)
        reader.client.call(P.EndSession(engine=reader.id, request="f"))
        reader.client.call(P.EndSession(engine=reader.id, request="m"))
        c_ = no_pins_left(watcher)
        assert c_["commits_fenced"] == int(fenced) and c_["reservations"] == 0, c_


def test_an_unregister_behind_a_huge_commit_lets_it_publish_and_answer(servers):
    """Unregister sent right behind a 24,000-object commit (which works in turns): the Unregister answers, the
    commit still publishes everything it was asked to and answers Committed; another engine of the namespace
    then hits all of it with its bytes, and nothing stays pinned, reserved or parked."""
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=4)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, reader = Engine(c, MIXED, chunk_tokens=CT), Engine(watcher, MIXED, chunk_tokens=CT)
        keys = eng.keys(BIG_N, seed=7)
        prep = c.call(P.PrepareStore(engine=eng.id, request="w", keys=keys,
                                     objects=[(ch, g) for ch in range(BIG_N) for g in range(4)]))[0]
        for sl in prep.slots:
            eng.arena[sl.offset:sl.offset + sl.length] = eng.payload(keys[sl.chunk], sl.group, sl.length)
        commit = c.submit(P.CommitStore(engine=eng.id, reservation=prep.reservation))
        assert isinstance(c.submit(P.Unregister(engine=eng.id)).result(timeout=60)[0], P.Done)
        assert commit.result(timeout=60)[0].objects == 4 * BIG_N
        hit = reader.lookup(keys, request="f")
        assert hit.hit_chunks == BIG_N
        reader.check(keys, hit)
        watcher.call(P.EndSession(engine=reader.id, request="f"))
        assert no_pins_left(watcher)["reservations"] == 0


# ---- 4. objects that change between its turns ----------------------------------------------------------------

ATTENTION_ONLY = ModelLayout(model="turns-attention", groups=tuple(
    GroupLayout(kind="attention", layer_names=(f"a{g}",), page_bytes=2, block_tokens=1) for g in range(4)))


def test_objects_evicted_or_replaced_between_turns_are_never_answered(servers):
    """Once the lookup has begun pinning, a Clear of every namespace drops what it has not pinned yet, and another
    namespace stores objects of its own (other bytes) under the same keys. The lookup answers the prefix it had
    pinned, every object the engine's own with its bytes; it is the hit a lookup asked afterwards finds. (An
    attention-only layout: with a recurrent group the cleared states of the earlier chunks would leave no hit.)"""
    s = servers("s", l1_gib=0.3, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as other:
        eng = Engine(c, ATTENTION_ONLY, chunk_tokens=CT)
        keys = eng.keys(BIG_N, seed=2)
        eng.store(keys)
        intruder = Engine(other, ATTENTION_ONLY, chunk_tokens=CT, salt="intruder")
        fut = c.submit(P.Lookup(engine=eng.id, request="r", keys=keys))
        while stats(other)["l1_pinned_objects"] == 0:  # its hit rule has run; it pins, piece by piece
            assert not fut.done()
        other.call(P.Clear())
        prep = other.call(P.PrepareStore(engine=intruder.id, request="x", keys=keys, objects=[
            (ch, g) for ch in range(BIG_N) for g in range(4)]))[0]
        for o in prep.slots:
            intruder.arena[o.offset:o.offset + o.length] = 0xEE  # not the engine's bytes
        other.call(P.CommitStore(engine=intruder.id, reservation=prep.reservation))
        res = fut.result(timeout=60)[0]
        eng.check(keys, res)  # the engine's own bytes: none of the intruder's objects
        assert [(o.chunk, o.group) for o in res.objects] == resume_objects(ATTENTION_ONLY, "boundary",
                                                                             res.hit_chunks, 0, CT)
        assert 0 < res.hit_chunks < BIG_N and prep.slots, res.hit_chunks  # the clear dropped what was not pinned
        probe = c.call(P.Lookup(engine=eng.id, request="p", keys=keys, pin=False))[0]
        assert probe.hit_chunks == res.hit_chunks
        c.call(P.Release(engine=eng.id, lease=res.lease))
        no_pins_left(other)


def test_objects_stored_between_turns_give_one_of_the_hits_before_or_after(servers):
    """The second half of the prompt is committed while a lookup of the whole prompt works: it answers the first
    half or the whole (never a length in between, never an object not there), every object with its bytes."""
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, keys = stored(c, BIG_N // 2)
        more = eng.keys(BIG_N, seed=0)
        assert more[:BIG_N // 2] == keys
        fut = c.submit(P.Lookup(engine=eng.id, request="r", keys=more))
        while_working(watcher, fut)
        eng.store(more, [(ch, g) for ch in range(BIG_N // 2, BIG_N) for g in range(4)])
        res = fut.result(timeout=60)[0]
        assert res.hit_chunks in (BIG_N // 2, BIG_N), res.hit_chunks
        eng.check(more, res)
        assert [(o.chunk, o.group) for o in res.objects] == resume_objects(MIXED, "boundary", res.hit_chunks, 0, CT)
        c.call(P.Release(engine=eng.id, lease=res.lease))
        no_pins_left(watcher)


def test_a_big_pin_false_lookup_takes_turns_too(servers):
    """An unpinned large lookup (the hit rule alone) also lets other requests through, and pins nothing."""
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, keys = stored(c)
        fut = c.submit(P.Lookup(engine=eng.id, request="r", keys=keys, pin=False))
        while_working(watcher, fut)
        res = fut.result(timeout=60)[0]
        assert res.hit_chunks == BIG_N and res.lease == 0 and res.objects == []
        no_pins_left(watcher)


def test_shutdown_mid_lookup_answers_shutting_down(servers):
    s = servers("s", l1_gib=0.2, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng, keys = stored(c)
        fut = c.submit(P.Lookup(engine=eng.id, request="r", keys=keys))
        while_working(watcher, fut)
        s.proc.terminate()
        with pytest.raises(ServerError) as err:
            fut.result(timeout=60)
        assert err.value.code == "shutting_down"
    assert s.proc.wait(30) == 0
    assert not Path(s.arena_path).exists()


def damage(l2_dir: Path, key: bytes, group: int) -> None:
    """Flip the last payload byte of an object's L2 file: its read fails its checksum."""
    (path,) = l2_dir.rglob(f"{key.hex()}-{group}.obj")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_an_engine_gone_while_its_lookup_lets_go_of_an_earlier_pass_leaves_no_pin(servers, tmp_path):
    """A lookup whose L2 reads failed partly starts over at a shorter hit, and before answering lets go, in turns, of
    what its earlier pass pinned past it; the engine unregistered in one of those turns. Those pins were held by the
    answering step alone: the lookup answered unknown_engine and they stayed pinned for good (an object nobody holds
    and nothing evicts). The watcher sends the Unregister once it sees the pinned count fall (that letting go under
    way)."""
    l2 = ("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1")
    first = servers("first", *l2, "--flush-on-exit", l1_gib=0.3)
    with CacheClient(first.endpoint, timeout_s=60) as c:
        _, keys = stored(c, 6000)
    assert first.stop() == 0
    damage(tmp_path / "l2", keys[600], 0)  # the hit of the pass after the reads ends there
    s = servers("s", *l2, "--io-threads", "2", l1_gib=0.3, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as watcher:
        eng = Engine(c, MIXED, chunk_tokens=CT)  # the namespace the first server stored under
        c.keepalive(eng.id, 0.1)
        fut = c.submit(P.Lookup(engine=eng.id, request="r", keys=keys, policy="all"))
        most = 0
        deadline = time.monotonic() + 60
        while not fut.done():
            pinned = stats(watcher)["l1_pinned_objects"]
            most = max(most, pinned)
            if most - pinned > 1000:  # the earlier pass's pins past the shorter hit are being let go
                c.call(P.Unregister(engine=eng.id))
                break
            assert time.monotonic() < deadline
        with pytest.raises(ServerError) as err:
            fut.result(timeout=60)
        assert err.value.code == "unknown_engine", err.value
        time.sleep(0.2)
        c = settled(watcher)
        assert c["l1_pinned_objects"] == 0 and c["leases"] == 0 and c["parked"] == 0, c


def test_large_lookups_of_one_engine_working_together_get_no_more_leases_than_its_limit(servers):
    """20 large lookups of one engine sent together, on a server with --max-leases 2: each found room when it came
    (none had answered yet), and each took a lease when it answered: 20 leases held, the limit (and the memory bound
    of docs/protocol.md that counts on it) passed ten times. Now 2 answer with a lease, 18 `limit`, leaving no pin."""
    s = servers("s", "--max-leases", "2", l1_gib=0.2, turn_s=0.0, slice_objects=2)
    with CacheClient(s.endpoint, timeout_s=60) as c:
        eng, keys = stored(c, 2000)
        futs = [c.submit(P.Lookup(engine=eng.id, request=f"r{i}", keys=keys)) for i in range(20)]
        leases, refused = [], 0
        for f in futs:
            try:
                res = f.result(timeout=60)[0]
                assert res.hit_chunks == 2000
                eng.check(keys, res)
                leases.append(res.lease)
            except ServerError as e:
                assert e.code == "limit" and "--max-leases 2" in e.message, e
                refused += 1
        assert (len(leases), refused) == (2, 18)
        assert stats(c)["leases_max_engine"] == 2
        for lease in leases:
            c.call(P.Release(engine=eng.id, lease=lease))
        no_pins_left(c)
