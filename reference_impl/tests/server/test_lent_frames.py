"""Reply frames that are views of the arena keep their objects' bytes until libzmq lets go of them (issue 35, 1).

A raw Retrieve of objects of 64 KiB or more answers with zero-copy frames that libzmq sends later. A client that
pipelines a Release (EndSession, Unregister, or goes silent until reclaimed) right behind its Retrieve and reads
the reply later must still read its own bytes, whatever another tenant stored meanwhile: the frames' slots are
not reused until libzmq has let go of them (server/books/loans.py). Real server processes; the attacker never maps
the arena.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq
from hybridkv.baselines.codec import decode_tensor
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.wire import protocol as P
from serverkit import Engine, counters

CT = 256  # tokens a chunk: 16 blocks of 16 tokens of a 16 KiB page, one object of 256 KiB
LAYOUT = ModelLayout(model="big", groups=(GroupLayout(kind="attention", layer_names=("l0",), page_bytes=16 << 10,
                                                      block_tokens=16),))
OBJECT = 256 << 10
L1_GIB = 8 / 1024  # 32 objects: the other tenant's store needs the attacker's slots
N = 24             # the attacker's objects


class Dealer:
    """A bare DEALER that reads one reply at a time and lets libzmq hold at most one more (RCVHWM 1): a reply it
    has not read stays, past the first, in the server's send queue, its frames not yet copied out of the arena."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(endpoint)
        self.ids = iter(range(1, 1 << 30))
        self.early: dict[int, tuple[P.Message, list[bytes]]] = {}

    def send(self, msg: P.Message, frames: list | tuple = ()) -> int:
        msg.id = next(self.ids)
        self.sock.send_multipart([P.encode(msg), *frames])
        return msg.id

    def recv(self, req_id: int) -> tuple[P.Message, list[bytes]]:
        """The reply to `req_id`; replies to others that come first are put aside (a deferred answer may come
        after a later request's)."""
        while req_id not in self.early:
            out = self.sock.recv_multipart()
            reply = P.decode_reply(out[0])
            self.early[reply.id] = reply, out[1:]
        reply, frames = self.early.pop(req_id)
        assert not isinstance(reply, P.Error), reply
        return reply, frames

    def call(self, msg: P.Message, frames: list | tuple = ()) -> P.Message:
        return self.recv(self.send(msg, frames))[0]

    def close(self) -> None:
        self.sock.close(linger=0)



def wait_for(admin: CacheClient, ok: Callable[[dict], bool], what: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not ok(c := counters(admin)):
        assert time.monotonic() < deadline, f"{what}: {c}"
        time.sleep(0.02)
    return c


def given_back(c: dict) -> bool:
    return c["l1_lent_objects"] == 0 and c["l1_lent_dropped_slots"] == 0 and c["l1_pinned_objects"] == 0


def leased_attacker(endpoint: str) -> tuple[Dealer, int, list[bytes], P.LookupResult]:
    """A client of its own salted namespace that stored N objects (raw frames) and holds a lease on them."""
    a = Dealer(endpoint)
    reg = a.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="attacker"))
    assert reg.object_bytes == [OBJECT]
    tokens = np.random.default_rng(1).integers(0, 50000, N * CT)
    keys = chunk_keys(reg.namespace, tokens, CT)
    prep = a.call(P.PrepareStore(engine=reg.engine, request="r", keys=keys, objects=[(c, 0) for c in range(N)]))
    assert len(prep.slots) == N
    a.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation, format="raw"),
           [Engine.payload(keys[s.chunk], s.group, s.length) for s in prep.slots])
    res = a.call(P.Lookup(engine=reg.engine, request="r", keys=keys, policy="all"))
    assert res.hit_chunks == N and res.lease
    return a, reg.engine, keys, res


def victim_stores(endpoint: str) -> None:
    """Another tenant (another salt) stores as much as the L1 takes: with the attacker's objects unpinned, into
    their slots."""
    with CacheClient(endpoint, timeout_s=30) as c:
        b = Engine(c, layout=LAYOUT, chunk_tokens=CT, salt="victim")
        keys = b.keys(48, seed=2)
        for i in range(0, len(keys), 8):
            b.store(keys[i:i + 8])  # refused objects (no room) are left out of its reservation


RELEASES: dict[str, Callable[[int, P.LookupResult], P.Message | None]] = {
    "release": lambda eng, res: P.Release(engine=eng, lease=res.lease),
    "end_session": lambda eng, res: P.EndSession(engine=eng, request="r"),
    "unregister": lambda eng, res: P.Unregister(engine=eng),
    "reclaim": lambda eng, res: None,  # silent past --client-timeout
}


@pytest.mark.parametrize("how", list(RELEASES))
def test_a_retrieve_released_before_its_reply_is_read_still_carries_its_own_bytes(server_factory, how):
    timeout = 2.0 if how == "reclaim" else 30.0  # long enough for the setup's gaps on a loaded machine
    srv = server_factory(l1_gib=L1_GIB, client_timeout=timeout)
    a, eng, keys, res = leased_attacker(srv.endpoint)
    with CacheClient(srv.endpoint, timeout_s=30) as admin:
        first = a.send(P.Heartbeat(engine=eng))  # its reply fills the client's queue: the next waits in the server's
        retrieve = a.send(P.Retrieve(engine=eng, lease=res.lease, format="raw"))
        release = RELEASES[how](eng, res)
        if release is not None:
            a.send(release)
        wait_for(admin, lambda c: c["leases"] == 0, "the lease closed")
        victim_stores(srv.endpoint)
        during = counters(admin)
        a.recv(first)
        reply, frames = a.recv(retrieve)
        assert len(frames) == N
        wrong = [o.chunk for o, f in zip(reply.objects, frames, strict=True)
                 if not np.array_equal(np.frombuffer(f, np.uint8), Engine.payload(keys[o.chunk], o.group, o.length))]
        assert not wrong, f"{len(wrong)} of {N} frames carry bytes that are not the attacker's: chunks {wrong}"
        assert during["l1_lent_objects"] == N  # held by the frames, not by any lease
        if how != "reclaim":  # a reclaimed lease's pins stay through the quarantine, so nothing evicts them yet
            assert during["l1_lent_dropped_slots"] > 0, during  # the other tenant's store did evict them
        # once libzmq has let go of the frames, their slots are free
        wait_for(admin, given_back, "the loans back")
    a.close()
    assert srv.alive()


def test_frames_a_client_never_reads_are_given_back_when_it_disconnects(server_factory):
    """A client that releases and never reads holds its unread frames' slots only until it goes away; the
    objects themselves are evicted meanwhile as any others."""
    srv = server_factory(l1_gib=L1_GIB)
    a, eng, keys, res = leased_attacker(srv.endpoint)
    with CacheClient(srv.endpoint, timeout_s=30) as admin:
        a.send(P.Heartbeat(engine=eng))
        a.send(P.Retrieve(engine=eng, lease=res.lease, format="raw"))
        a.send(P.Release(engine=eng, lease=res.lease))
        held = wait_for(admin, lambda c: c["leases"] == 0, "the lease closed")
        assert held["l1_lent_objects"] == N and held["l1_pinned_objects"] == 0
        victim_stores(srv.endpoint)
        during = counters(admin)
        assert during["l1_lent_objects"] == N and during["l1_lent_dropped_slots"] > 0, during
        a.close()
        after = wait_for(admin, given_back, "the loans back")
        assert after["l1_free_bytes"] >= during["l1_free_bytes"] + during["l1_lent_dropped_slots"] * OBJECT
    assert srv.alive()


@pytest.mark.parametrize("fmt", ["pickle", "torch_save"])
def test_a_legacy_retrieve_released_before_its_worker_encodes_carries_its_own_bytes(server_factory, fmt):
    """pickle and torch_save replies are encoded on a worker after the handler returned: the loan covers the job
    (the server's first one imports torch there, which leaves the other tenant plenty of time)."""
    torch = pytest.importorskip("torch")
    srv = server_factory(l1_gib=L1_GIB)
    a, eng, keys, res = leased_attacker(srv.endpoint)
    with CacheClient(srv.endpoint, timeout_s=30) as admin:
        retrieve = a.send(P.Retrieve(engine=eng, lease=res.lease, format=fmt))
        a.send(P.Release(engine=eng, lease=res.lease))
        wait_for(admin, lambda c: c["leases"] == 0, "the lease closed")
        victim_stores(srv.endpoint)
        reply, frames = a.recv(retrieve)
        wrong = [o.chunk for o, f in zip(reply.objects, frames, strict=True)
                 if not np.array_equal(decode_tensor(fmt, f).contiguous().view(-1).view(torch.uint8).numpy(),
                                       Engine.payload(keys[o.chunk], o.group, o.length))]
        assert not wrong, f"{len(wrong)} of {N} objects decode to bytes that are not the attacker's: chunks {wrong}"
        wait_for(admin, given_back, "the loans back")
    a.close()
