"""A Retrieve answers at most --max-retrieve-objects objects: the slice of the lease from `Retrieve.first` on.

A reply's payload frames are one multipart message, handed to libzmq in one step of the server's loop, so a raw
Retrieve of a large lease kept every other client waiting (results/cpu/2026-12-08/hostile). Now a client pages
(`CacheClient.call` does it for every caller) and the other clients are answered between the slices. Real server
processes; the bytes checked against what was stored.
"""

from __future__ import annotations

import threading

import msgspec
import pytest
from hybridkv.baselines.codec import decode_tensor
from hybridkv.engine.client import CacheClient
from hybridkv.server.books.config import ConfigError, ServerConfig
from hybridkv.wire import protocol as P
from serverkit import Engine, RawDealer, alive, expect

CAP = 16
CHUNKS = 21  # x 4 groups of the tiny hybrid: 84 objects, six slices (the last of 4)


@pytest.fixture
def leased(server_factory):
    """A server of --max-retrieve-objects CAP, a client, an engine with CHUNKS chunks stored and a lease on all
    their objects."""
    s = server_factory("--max-retrieve-objects", str(CAP))
    with CacheClient(s.endpoint, timeout_s=30) as c:
        eng = Engine(c)
        keys = eng.keys(CHUNKS)
        eng.store(keys)
        res = eng.lookup(keys, policy="all")
        assert res.hit_chunks == CHUNKS and len(res.objects) == CHUNKS * 4 > CAP
        yield s, c, eng, keys, res


def check_bytes(eng: Engine, keys: list[bytes], objects: list[P.ObjectLoc], frames: list, fmt: str = "raw") -> None:
    assert len(frames) == len(objects)
    for o, f in zip(objects, frames, strict=True):
        if fmt != "raw":  # the seed's formats: one serialized tensor per object
            import torch

            f = decode_tensor(fmt, f).contiguous().view(-1).view(torch.uint8).numpy()
        assert bytes(f) == eng.payload(keys[o.chunk], o.group, o.length).tobytes(), (o.chunk, o.group)


def raw_lease(s, eng: Engine, keys: list[bytes], request: str = "r") -> tuple[RawDealer, int, P.LookupResult]:
    """A bare DEALER with an engine of its own (an engine belongs to its connection) on `eng`'s namespace, and its
    lease on every object of `keys`."""
    d = RawDealer(s.endpoint)
    reg = d.request(P.Register(layout=eng.layout, chunk_tokens=eng.chunk_tokens))
    return d, reg.engine, d.request(P.Lookup(engine=reg.engine, request=request, keys=keys, policy="all"))


@pytest.mark.parametrize("fmt", ["raw", "pickle"])
def test_a_lease_over_the_cap_is_retrieved_whole_and_exact_through_the_client(leased, fmt):
    s, c, eng, keys, res = leased
    rep, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease, format=fmt))
    assert rep.objects == res.objects and rep.total == rep.next == len(res.objects)
    check_bytes(eng, keys, rep.objects, frames, fmt)
    # a slice of its own, from the middle: the cap's worth (_call: one request, no paging)
    rep, frames = c._call(P.Retrieve(engine=eng.id, lease=res.lease, first=CAP + 3), (), None)
    assert rep.objects == res.objects[CAP + 3:2 * CAP + 3] and (rep.total, rep.next) == (len(res.objects), 2 * CAP + 3)
    check_bytes(eng, keys, rep.objects, frames)


def test_each_reply_holds_at_most_the_cap_and_says_where_the_next_slice_starts(leased):
    s, c, eng, keys, res = leased
    d, engine, res = raw_lease(s, eng, keys)
    try:
        at, got, frames = 0, [], []
        while True:
            rep, fr = d.call([P.encode(P.Retrieve(engine=engine, lease=res.lease, first=at))])
            assert isinstance(rep, P.Retrieved) and len(rep.objects) == len(fr) <= CAP, rep
            got += rep.objects
            frames += fr
            if rep.next == rep.total:
                break
            at = rep.next
        assert got == res.objects
        check_bytes(eng, keys, got, frames)
    finally:
        d.close()


def test_an_old_shape_retrieve_gets_the_whole_lease_under_the_cap_and_a_limit_naming_it_over(server_factory):
    """A request without `first` (a client from before paging): the whole lease in a reply without the new fields
    (such a client decodes replies forbidding unknown fields) while the lease fits; over the cap, `limit` naming
    the flag and the paging field."""
    s = server_factory("--max-retrieve-objects", str(CAP))
    with CacheClient(s.endpoint, timeout_s=30) as c:
        eng = Engine(c)
        keys = eng.keys(CHUNKS)
        eng.store(keys)
        d, engine, small = raw_lease(s, eng, keys[:CAP // 4], "small")
        try:
            big = d.request(P.Lookup(engine=engine, request="big", keys=keys, policy="all"))
            assert len(small.objects) == CAP and len(big.objects) == CHUNKS * 4
            d.sock.send(P.encode(P.Retrieve(engine=engine, lease=small.lease)))
            out = d.sock.recv_multipart()
            fields = msgspec.msgpack.decode(out[0])
            assert fields["op"] == "retrieved" and "total" not in fields and "next" not in fields, fields
            check_bytes(eng, keys, small.objects, out[1:])
            err = d.request(P.Retrieve(engine=engine, lease=big.lease))
            assert isinstance(err, P.Error) and err.code == "limit", err
            assert f"--max-retrieve-objects {CAP}" in err.message and "Retrieve.first" in err.message, err.message
        finally:
            d.close()
        assert alive(s.endpoint)


@pytest.mark.parametrize("first", [-1, CHUNKS * 4, CHUNKS * 4 + 1, (1 << 64) - 1, -(1 << 63)])
def test_a_slice_outside_the_lease_is_bad_request_naming_it_and_the_server_serves_on(leased, first):
    s, c, eng, keys, res = leased
    e = expect("bad_request", lambda: c._call(P.Retrieve(engine=eng.id, lease=res.lease, first=first), (), None))
    assert f"Retrieve.first {first}" in e.message and f"{len(res.objects)} objects" in e.message, e.message
    rep, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease))  # the lease is still there, whole
    check_bytes(eng, keys, rep.objects, frames)


@pytest.mark.parametrize("first", ["0", 1.5, [0]])
def test_a_slice_field_of_the_wrong_type_or_size_is_bad_message(leased, first):
    s, c, eng, keys, res = leased
    d, engine, res = raw_lease(s, eng, keys)
    try:
        err = d.request({"op": "retrieve", "v": 1, "id": 7, "engine": engine, "lease": res.lease, "first": first})
        assert isinstance(err, P.Error) and err.code == "bad_message" and err.id == 7, err
        assert "first" in err.message or "integer" in err.message.lower(), err.message
    finally:
        d.close()
    assert alive(s.endpoint)


def test_another_client_is_answered_between_two_slices(leased):
    """The retrieving client holds its first slice until another client's Health has been answered, then asks for
    the rest: before paging there was no 'between' (one reply of every object); now the rest are requests of their
    own, and the whole lease still arrives exact."""
    s, c, eng, keys, res = leased
    first_slice, answered = threading.Event(), threading.Event()
    firsts = []
    call = c._call

    def held(msg, frames, timeout):  # the first slice's request goes through _call, the rest through submit
        out = call(msg, frames, timeout)
        firsts.append(len(out[1]))
        first_slice.set()
        assert answered.wait(30), "the other client's Health was not answered between two slices"
        return out

    c._call = held  # type: ignore[method-assign]
    got = []
    t = threading.Thread(target=lambda: got.append(c.call(P.Retrieve(engine=eng.id, lease=res.lease))))
    t.start()
    with CacheClient(s.endpoint, timeout_s=30) as other:
        assert first_slice.wait(30)
        assert other.call(P.Health())[0].status == "ok"
        answered.set()
    t.join(60)
    assert not t.is_alive() and firsts == [CAP] and len(got) == 1, (firsts, got)
    rep, frames = got[0]
    assert rep.objects == res.objects
    check_bytes(eng, keys, rep.objects, frames)


def test_a_release_between_slices_ends_the_lease(leased):
    """The lease stays pinned between slices until it is released: the next slice is then `unknown_lease`, and the
    slice already read is the lease's bytes."""
    s, c, eng, keys, res = leased
    d, engine, res = raw_lease(s, eng, keys)
    try:
        rep, frames = d.call([P.encode(P.Retrieve(engine=engine, lease=res.lease, first=0))])
        assert isinstance(rep, P.Retrieved) and rep.next == CAP, rep
        assert isinstance(d.request(P.Release(engine=engine, lease=res.lease)), P.Done)
        err = d.request(P.Retrieve(engine=engine, lease=res.lease, first=rep.next))
        assert isinstance(err, P.Error) and err.code == "unknown_lease", err
        check_bytes(eng, keys, rep.objects, frames)
    finally:
        d.close()


def test_the_cap_is_checked_at_the_door():
    for bad in (0, -1, 1 << 62):
        with pytest.raises(ConfigError, match="max_retrieve_objects"):
            ServerConfig(l1_bytes=1 << 20, max_retrieve_objects=bad)
