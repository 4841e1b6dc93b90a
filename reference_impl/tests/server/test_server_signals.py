"""A real server process that is stopped (SIGSTOP, as a VM pause or swap stops it) or told to exit (SIGTERM)
while engines hold leases and have requests in flight (issue 35, items 2 and 6)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.keys import chunk_keys
from hybridkv.wire import protocol as P
from serverkit import Engine

STOP_S = 5.0  # how long the server is stopped: longer than its --client-timeout
BURST = 250  # requests each client pipelines before SIGTERM: more than the server answers before it comes


def stats(client: CacheClient) -> dict:
    return client.call(P.Stats())[0].counters


def overwritten(eng: Engine, keys: list[bytes], res: P.LookupResult) -> int:
    """How many of a lease's objects no longer hold the bytes stored."""
    return sum(not np.array_equal(eng.arena[o.offset:o.offset + o.length], eng.payload(keys[o.chunk], o.group,
                                                                                        o.length))
               for o in res.objects)


def fill_l1(eng: Engine, l1_bytes: int) -> None:
    """Store twice what L1 holds: every object nobody pins is evicted and its slot written again."""
    per_key = sum(eng.sizes)
    for i in range(2 * l1_bytes // per_key // 32 + 1):
        eng.store(eng.keys(32, seed=10_000 + i), request=f"fill{i}")


def test_a_server_stopped_longer_than_the_client_timeout_reclaims_no_live_engine(server_factory):
    """Stopped past --client-timeout, then continued: the engines heartbeated all along (their heartbeats waited
    in the socket), so none is reclaimed, and the objects under their leases are not written over by the next
    store. The server measures silence by the time it ran, not by the wall clock."""
    l1_gib = 0.01
    srv = server_factory("--quarantine", "1", l1_gib=l1_gib, client_timeout=3)
    clients = [CacheClient(srv.endpoint, timeout_s=30) for _ in range(3)]
    try:
        leased = []
        for i, c in enumerate(clients):
            eng = Engine(c, name=f"live{i}")
            c.keepalive(eng.id, eng.reg.heartbeat_s)
            keys = eng.keys(4, seed=100 + i)
            eng.store(keys)
            res = eng.lookup(keys, policy="all")
            assert len(res.objects) == 16
            leased.append((eng, keys, res))
        with CacheClient(srv.endpoint, timeout_s=30) as other:
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                time.sleep(STOP_S)  # the stop itself, not a wait for something
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            # The first loop turn after the stop runs a tick (it was due long ago): an answer to a request sent
            # after another's answer comes after that tick.
            stats(other)
            st = stats(other)
            filler = Engine(other, name="filler")
            fill_l1(filler, int(l1_gib * (1 << 30)))
            lost = [overwritten(eng, keys, res) for eng, keys, res in leased]
            after = stats(other)
            print(f"after a {STOP_S:g} s stop (--client-timeout 3): {st['engines_reclaimed']} of 3 live engines "
                  f"reclaimed, {lost} of 16 leased objects each overwritten by the next store")
            assert st["engines_reclaimed"] == 0 and after["engines_reclaimed"] == 0, "a live engine was reclaimed"
            assert st["loop_stalls"] >= 1, "the stop was not seen"
            assert lost == [0, 0, 0], "objects under a live lease were written over"
            assert after["l1_pinned_objects"] == 48
            for (eng, _, res), c in zip(leased, clients, strict=True):
                c.call(P.Heartbeat(engine=eng.id))
                assert c.call(P.Release(engine=eng.id, lease=res.lease))[0].count == 16
    finally:
        for c in clients:
            c.close()


def test_a_reclaimed_lease_keeps_its_objects_through_the_quarantine(server_factory):
    """An engine really silent past --client-timeout is reclaimed, but it may still read the objects of its lease
    through its mapping: they stay pinned for --quarantine, so a store meanwhile does not write over them."""
    l1_gib = 0.01
    srv = server_factory("--quarantine", "60", l1_gib=l1_gib, client_timeout=1)
    with CacheClient(srv.endpoint, timeout_s=30) as silent_c, CacheClient(srv.endpoint, timeout_s=30) as other:
        silent = Engine(silent_c, name="silent")  # no heartbeats: reclaimed after a second
        keys = silent.keys(4, seed=7)
        silent.store(keys)
        res = silent.lookup(keys, policy="all")
        filler = Engine(other, name="filler")
        other.keepalive(filler.id, filler.reg.heartbeat_s)
        deadline = time.monotonic() + 30
        while stats(other)["engines_reclaimed"] == 0:
            assert time.monotonic() < deadline, "the silent engine was never reclaimed"
            time.sleep(0.05)
        st = stats(other)
        assert st["leases"] == 0 and st["l1_pinned_objects"] == 16, "the reclaimed lease's pins were let go at once"
        fill_l1(filler, int(l1_gib * (1 << 30)))
        assert overwritten(silent, keys, res) == 0, "a reclaimed lease's objects were written over in quarantine"
        with pytest.raises(ServerError, match="unknown_engine"):
            silent_c.call(P.Heartbeat(engine=silent.id))


def test_sigterm_answers_every_request_that_reached_the_socket(server_factory):
    """Clients storing in a loop when SIGTERM comes: each request that reaches the server until it closes its socket
    is answered (done, or `shutting_down`), including those sent after the first refusals went out; none waits
    out its client's timeout."""
    srv = server_factory(l1_gib=0.05)
    n = 15
    clients = [CacheClient(srv.endpoint, timeout_s=30) for _ in range(n)]
    rounds = [0] * n
    all_going = threading.Barrier(n + 1)

    def store_in_a_loop(i: int) -> str:
        """Prepare and commit until the server refuses; what ended it."""
        eng = Engine(clients[i], name=f"e{i}")
        try:
            while True:
                eng.store(eng.keys(2, seed=1000 * i + rounds[i]), objects=[(0, 0), (1, 0)], request=str(rounds[i]))
                rounds[i] += 1
                if rounds[i] == 3:
                    all_going.wait(timeout=60)
        except ServerError as e:
            return e.code
        except TimeoutError:
            return "stranded"

    try:
        with ThreadPoolExecutor(n) as pool:
            futs = [pool.submit(store_in_a_loop, i) for i in range(n)]
            all_going.wait(timeout=60)
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            ends = [f.result(timeout=60) for f in futs]
            took = time.monotonic() - t0
        stranded = ends.count("stranded")
        print(f"SIGTERM with {n} clients storing: {stranded} stranded, the others answered {set(ends)} "
              f"within {took:.1f} s")
        assert stranded == 0 and took < 10, f"{stranded} of {n} clients waited out their timeout"
        assert set(ends) == {P.ErrorCode.SHUTTING_DOWN}
        assert srv.proc.wait(timeout=30) == 0
    finally:
        for c in clients:
            c.close()


def test_sigterm_answers_requests_that_come_while_the_l2_writes_finish(server_factory, tmp_path):
    """With --flush-on-exit the server writes its dirty objects to L2 before it exits; a request that comes
    meanwhile (here: sent after another was refused) is refused too, not left to its client's timeout (with a flush
    of 256 synced objects, each of 20 requests sent in turn after the first refusal was refused at once; before,
    the first of them waited out its timeout)."""
    srv = server_factory("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1", "--l2-fsync", "--io-threads", "1",
                         "--spill-watermark", "0", "--flush-on-exit", l1_gib=0.05)
    with CacheClient(srv.endpoint, timeout_s=20) as c:
        eng = Engine(c)
        eng.store(eng.keys(64, seed=7))  # 256 objects to write, each synced: the flush takes a while
        srv.proc.send_signal(signal.SIGTERM)
        while True:  # answered until the loop stops; the first refusal says the server is closing
            try:
                c.call(P.Health())
            except ServerError as e:
                assert e.code == P.ErrorCode.SHUTTING_DOWN, e
                break
        st = time.monotonic()
        for _ in range(20):  # requests that come while the server writes to L2: each refused at once
            with pytest.raises(ServerError, match="shutting_down"):
                c.call(P.Health())
        running = srv.proc.poll() is None
        print(f"20 requests during the flush at exit answered in {time.monotonic() - st:.3f} s")
    assert running, "the server exited before the requests: nothing tested"
    assert srv.proc.wait(timeout=60) == 0


def test_sigterm_behind_pipelined_requests_answers_each_and_lent_frames_keep_their_bytes(server_factory):
    """Clients that pipelined a burst (raw Retrieves of lent 256 KiB objects, lookups, session ends, heartbeats)
    the server is midway through when SIGTERM comes: every request is answered, its real answer or `shutting_down`,
    each Retrieved frame (lent, sent after the stop began) carries the client's own bytes, and the server exits 0."""
    from test_lent_frames import CT, LAYOUT, Dealer

    srv = server_factory(l1_gib=0.05)
    clients = []
    for c in range(4):
        d = Dealer(srv.endpoint)
        d.sock.setsockopt(zmq.RCVHWM, 1000)
        reg = d.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt=f"c{c}"))
        keys = chunk_keys(reg.namespace, np.random.default_rng(c).integers(0, 50000, 4 * CT), CT)
        prep = d.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys, objects=[(k, 0) for k in range(4)]))
        d.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation, format="raw"),
               [Engine.payload(keys[o.chunk], o.group, o.length) for o in prep.slots])
        res = d.call(P.Lookup(engine=reg.engine, request="hold", keys=keys, policy="all"))
        assert res.hit_chunks == 4
        clients.append((d, reg.engine, keys, res))
    sent: list[list[int]] = []
    for d, eng, keys, res in clients:
        burst = []
        for i in range(BURST):
            msg = [P.Retrieve(engine=eng, lease=res.lease, format="raw"), P.Heartbeat(engine=eng),
                   P.Lookup(engine=eng, request=f"q{i}", keys=keys, policy="all"),
                   P.EndSession(engine=eng, request=f"q{i - 1}")][min(i % 8, 3)]
            burst.append(d.send(msg))
        sent.append(burst)
    first = clients[0][0]
    while sent[0][20] not in first.early:  # the server is well into the bursts, lent frames unread
        out = first.sock.recv_multipart()
        first.early[P.decode_reply(out[0]).id] = P.decode_reply(out[0]), out[1:]
    srv.proc.send_signal(signal.SIGTERM)
    answers: dict[str, int] = {}
    for (d, _, keys, _), burst in zip(clients, sent, strict=True):
        for req_id in burst:
            while req_id not in d.early:  # RCVTIMEO: a request never answered fails here, after 30 s
                out = d.sock.recv_multipart()
                d.early[P.decode_reply(out[0]).id] = P.decode_reply(out[0]), out[1:]
            reply, frames = d.early.pop(req_id)
            kind = reply.code if isinstance(reply, P.Error) else type(reply).__name__
            answers[kind] = answers.get(kind, 0) + 1
            if isinstance(reply, P.Retrieved):
                assert all(np.array_equal(np.frombuffer(f, np.uint8), Engine.payload(keys[o.chunk], o.group, o.length))
                           for o, f in zip(reply.objects, frames, strict=True))
    print(f"SIGTERM behind {4 * BURST} pipelined requests: {answers}")
    assert set(answers) <= {"Retrieved", "Done", "LookupResult", P.ErrorCode.SHUTTING_DOWN}, answers
    assert srv.proc.wait(timeout=30) == 0
    for d, *_ in clients:
        d.close()
