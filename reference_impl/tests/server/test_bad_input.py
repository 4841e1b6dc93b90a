"""Bad requests against a real server process: each gets an error reply naming the problem, and the
server goes on serving other clients (DESIGN.md, Server: "Every request is validated").

The tests share one server (the module's `server`): it keeps serving through every bad input of the module, each
test stores fresh keys (`_seeds`) and compares the counters it checks with their values before it, so a test sees
what a fresh server would show it. Frames the client library would never send go through a raw DEALER socket."""

from __future__ import annotations

import io
import itertools
import os
import pickle
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.layout import MAX_LAYERS, MAX_NAME_CHARS, GroupLayout, ModelLayout
from hybridkv.model.presets import preset_layout
from hybridkv.server.front.launch import ServerProcess
from hybridkv.wire import protocol as P
from serverkit import Engine, RawDealer, alive, counters, expect, module_server

E = P.ErrorCode
_seeds = itertools.count(1000)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module's tests: a fresh process for each cost more than most tests here."""
    with module_server() as s:
        yield s


def fresh_keys(eng: Engine, n: int) -> list[bytes]:
    """Keys no other test of the shared server stored."""
    return eng.keys(n, seed=next(_seeds))


@pytest.fixture
def raw(server):
    d = RawDealer(server.endpoint)
    yield d
    d.close()


def assert_error(reply: P.Message, code: str, *needles: str) -> None:
    assert isinstance(reply, P.Error), f"expected an error reply, got {reply!r}"
    assert reply.code == code, reply
    for n in needles:
        assert n in reply.message, f"{n!r} not in {reply.message!r}"


def assert_server_error(exc_info, code: str, *needles: str) -> None:
    err = exc_info.value
    assert err.code == code, err
    for n in needles:
        assert n in err.message, f"{n!r} not in {err.message!r}"


def assert_still_serving(endpoint: str) -> None:
    """A second, well-behaved client: Health, then a full shm store / lookup / read back / release."""
    with CacheClient(endpoint, timeout_s=10) as c:
        health, _ = c.call(P.Health())
        assert health.status == "ok"
        eng = Engine(c)
        keys = eng.keys(2, seed=next(_seeds))
        prep = eng.store(keys)
        assert len(prep.slots) == 8 and not prep.refused
        res = eng.lookup(keys, policy="all")
        assert res.hit_chunks == 2
        eng.check(keys, res)
        c.call(P.Release(engine=eng.id, lease=res.lease))


def as_dict(msg: P.Message) -> dict:
    """A message as the plain map the wire carries, for editing into something the structs forbid."""
    return msgspec.msgpack.decode(P.encode(msg))


def prepared(client: CacheClient, eng: Engine, n_chunks: int = 2) -> tuple[list[bytes], P.Prepared]:
    keys = fresh_keys(eng, n_chunks)
    objs = [(c, g) for c in range(n_chunks) for g in range(len(eng.layout.groups))]
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=objs))
    return keys, prep


# ---- frames that are not requests -----------------------------------------------------------------

@pytest.mark.parametrize("frame, needle", [
    (np.random.default_rng(7).integers(0, 256, 64, dtype=np.uint8).tobytes(), "undecodable request"),
    (b"", "truncated"),                                       # an empty message frame
    (msgspec.msgpack.encode([1, 2, 3]), "got `array`"),       # valid msgpack, not a map
    (msgspec.msgpack.encode("health"), "got `str`"),
    (msgspec.msgpack.encode({"v": 1}), "op"),                 # a map without the tag
], ids=["random-bytes", "empty-frame", "msgpack-array", "msgpack-str", "no-op"])
def test_garbage_frames_are_bad_messages(server, raw, frame, needle):
    assert_error(raw.call([frame])[0], E.BAD_MESSAGE, needle)
    assert_still_serving(server.endpoint)


def test_empty_multipart_is_a_bad_message(server, raw):
    # A DEALER cannot send zero frames; the nearest is an empty delimiter then an empty message.
    assert_error(raw.call([b"", b""])[0], E.BAD_MESSAGE, "truncated")
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("op", ["done", "lookup_result", "error", "frobnicate"])
def test_reply_types_and_unknown_ops_are_refused(server, raw, op):
    reply = raw.request({"op": op, "v": 1, "id": 5, "count": 1})
    assert_error(reply, E.BAD_MESSAGE, repr(op))
    assert reply.id == 5, "an undecodable request's error still echoes its id"
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("field, value, needles", [
    ("engine", "seven", ("$.engine", "str")),
    ("keys", ["not-bytes"], ("$.keys[0]", "str")),
    ("keys", b"0123456789abcdef", ("$.keys", "bytes")),
    ("skip_chunks", 1.5, ("$.skip_chunks", "float")),
    ("policy", "some", ("$.policy", "'some'")),
])
def test_wrong_field_types_are_named(server, raw, field, value, needles):
    msg = as_dict(P.Lookup(engine=2, request="r", keys=[bytes(16)]))
    msg[field] = value
    assert_error(raw.request(msg), E.BAD_MESSAGE, *needles)
    assert_still_serving(server.endpoint)


def test_the_client_library_gets_decode_errors_instead_of_timing_out(server):
    # msgspec structs do not validate on construction, so a caller can put a str where an int goes;
    # the error reply must echo the request id or the caller's future waits out its whole timeout.
    with CacheClient(server.endpoint, timeout_s=10) as c, pytest.raises(ServerError) as ei:
        c.call(P.Heartbeat(engine="seven"), timeout=5)  # type: ignore[arg-type]
    assert_server_error(ei, E.BAD_MESSAGE, "$.engine")
    assert_still_serving(server.endpoint)


def test_unknown_protocol_version(server, raw):
    assert_error(raw.request(P.Health(v=99, id=3)), E.VERSION, "99", str(P.PROTOCOL_VERSION))
    # a newer client's request may carry fields this server does not know: still a version error
    msg = as_dict(P.Health(v=99, id=4)) | {"priority": "high"}
    reply = raw.request(msg)
    assert_error(reply, E.VERSION, "99")
    assert reply.id == 4
    assert_still_serving(server.endpoint)


def test_unknown_fields_are_refused(server, raw):
    reply = raw.request(as_dict(P.Health(id=9)) | {"extra": 1})
    assert_error(reply, E.BAD_MESSAGE, "extra")
    # nested: an unknown field inside the layout of a register
    reg = as_dict(P.Register(layout=preset_layout("tiny-hybrid"), chunk_tokens=0))
    reg["layout"]["groups"][0]["compression"] = "zstd"
    assert_error(raw.request(reg), E.BAD_MESSAGE, "compression")
    assert_still_serving(server.endpoint)


# ---- payload frames --------------------------------------------------------------------------------

@pytest.mark.parametrize("delta", [+1, -1, -4096], ids=["oversized", "undersized", "short-by-a-page"])
def test_raw_commit_with_a_wrong_sized_frame(server, client, delta):
    eng = Engine(client)
    keys, prep = prepared(client, eng)
    frames = [eng.payload(keys[s.chunk], s.group, s.length) for s in prep.slots]
    bad = 3
    frames[bad] = np.zeros(prep.slots[bad].length + delta, np.uint8)
    with pytest.raises(ServerError) as ei:
        client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), frames)
    assert_server_error(ei, E.BAD_PAYLOAD, f"payload frame {bad}", str(prep.slots[bad].length + delta),
                        str(prep.slots[bad].length))
    assert eng.lookup(keys).hit_chunks == 0, "a refused commit makes nothing visible"
    # the reservation is still open: the engine can send the right frames
    frames[bad] = eng.payload(keys[prep.slots[bad].chunk], prep.slots[bad].group, prep.slots[bad].length)
    client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), frames)
    eng.check(keys, eng.lookup(keys, policy="all", request="q"))
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("count", [0, 7, 9])
def test_raw_commit_with_the_wrong_number_of_frames(server, client, count):
    eng = Engine(client)
    keys, prep = prepared(client, eng)
    assert len(prep.slots) == 8
    frames = [np.zeros(prep.slots[i % 8].length, np.uint8) for i in range(count)]
    with pytest.raises(ServerError) as ei:
        client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), frames)
    assert_server_error(ei, E.BAD_PAYLOAD, "needs 8 payload frames", f"got {count}")
    assert eng.lookup(keys).hit_chunks == 0
    assert_still_serving(server.endpoint)


def test_payload_frames_on_requests_that_take_none(server, client):
    eng = Engine(client)
    keys, prep = prepared(client, eng)
    junk = [b"x" * 100]
    for msg in (P.Health(), P.Stats(), P.Heartbeat(engine=eng.id),
                P.Lookup(engine=eng.id, request="r", keys=keys),
                P.CommitStore(engine=eng.id, reservation=prep.reservation, format="shm"),
                P.AbortStore(engine=eng.id, reservation=prep.reservation)):
        with pytest.raises(ServerError) as ei:
            client.call(msg, junk)
        assert_server_error(ei, E.BAD_PAYLOAD, type(msg).__name__, "got 1")
    # none of those took effect: the reservation is still open and commits
    client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
    assert_still_serving(server.endpoint)


def _legacy_commit(client, eng, fmt, make_frame):
    before = counters(client)
    keys, prep = prepared(client, eng, n_chunks=1)
    frames = [make_frame(s) for s in prep.slots]
    with pytest.raises(ServerError) as ei:
        client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format=fmt), frames)
    assert eng.lookup(keys).hit_chunks == 0
    # a payload that fails to decode aborts the reservation
    with pytest.raises(ServerError, match="unknown_reservation"):
        client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
    after = counters(client)
    assert after["reservations"] == before["reservations"] and after["l1_objects"] == before["l1_objects"]
    return ei


def test_pickle_payload_that_is_not_a_tensor(server, client):
    pytest.importorskip("torch")
    eng = Engine(client)
    ei = _legacy_commit(client, eng, "pickle", lambda s: pickle.dumps({"not": "a tensor"}))
    assert_server_error(ei, E.BAD_PAYLOAD, "dict", "not a tensor")
    assert_still_serving(server.endpoint)


class _RunsCommand:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_malicious_pickle_is_refused_never_executed(server, client, tmp_path):
    pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    eng = Engine(client)
    ei = _legacy_commit(client, eng, "pickle", lambda s: pickle.dumps(_RunsCommand(f"touch {marker}")))
    assert_server_error(ei, E.BAD_PAYLOAD, "refusing to unpickle", "system")
    assert not marker.exists(), "the server executed code from a pickle payload"
    assert_still_serving(server.endpoint)


def _global_call_pickle(module: str, name: str, arg: bytes | str) -> bytes:
    """A protocol-4 pickle that calls module.name(arg): STACK_GLOBAL resolves dotted names at proto 4."""
    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b
    a = s(arg) if isinstance(arg, str) else b"B" + len(arg).to_bytes(4, "little") + arg
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + a + b"\x85R."


def _nested_legacy_pickle(cmd: str) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(_RunsCommand(cmd), buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


@pytest.mark.parametrize("route", ["dotted-name", "dotted-module", "load_from_bytes"])
def test_malicious_pickle_through_torch_globals_is_refused(server, client, tmp_path, route):
    pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}"
    frame = {
        "dotted-name": lambda: _global_call_pickle("torch.serialization", "os.system", cmd),
        "dotted-module": lambda: _global_call_pickle("torch", "serialization.os.system", cmd),
        "load_from_bytes": lambda: _global_call_pickle("torch.storage", "_load_from_bytes",
                                                       _nested_legacy_pickle(cmd)),
    }[route]()
    eng = Engine(client)
    ei = _legacy_commit(client, eng, "pickle", lambda s: frame)
    assert ei.value.code == E.BAD_PAYLOAD
    assert_still_serving(server.endpoint)
    assert not marker.exists(), f"the server executed code from a pickle payload ({route})"


def test_torch_save_payload_of_the_wrong_size(server, client):
    torch = pytest.importorskip("torch")
    eng = Engine(client)

    def frame(s):
        buf = io.BytesIO()
        torch.save(torch.zeros((s.length - 2) // 2, dtype=torch.bfloat16), buf)
        return buf.getvalue()

    ei = _legacy_commit(client, eng, "torch_save", frame)
    size0 = eng.sizes[0]
    assert_server_error(ei, E.BAD_PAYLOAD, f"holds {size0 - 2} B", f"object is {size0} B")
    assert_still_serving(server.endpoint)


# ---- engines, reservations, leases ------------------------------------------------------------------

def test_requests_from_an_unregistered_engine(server, client):
    ghost = 987654
    for msg in (P.Heartbeat(engine=ghost), P.Lookup(engine=ghost, request="r", keys=[bytes(16)]),
                P.PrepareStore(engine=ghost, request="r", keys=[bytes(16)], objects=[(0, 0)]),
                P.CommitStore(engine=ghost, reservation=1), P.Release(engine=ghost, lease=1),
                P.EndSession(engine=ghost, request="r"), P.Clear(engine=ghost), P.Unregister(engine=ghost)):
        with pytest.raises(ServerError) as ei:
            client.call(msg)
        assert_server_error(ei, E.UNKNOWN_ENGINE, str(ghost))
    assert_still_serving(server.endpoint)


def test_double_commit(server, client):
    eng = Engine(client)
    keys, prep = prepared(client, eng)
    before = counters(client)["objects_committed"]
    client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
    with pytest.raises(ServerError) as ei:
        client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
    assert_server_error(ei, E.UNKNOWN_RESERVATION, str(prep.reservation))
    assert counters(client)["objects_committed"] - before == 8
    assert_still_serving(server.endpoint)


def test_commit_or_abort_of_another_engines_reservation(server, client):
    owner = Engine(client)
    keys, prep = prepared(client, owner)
    for s in prep.slots:
        owner.arena[s.offset:s.offset + s.length] = owner.payload(keys[s.chunk], s.group, s.length)
    with CacheClient(server.endpoint, timeout_s=10) as other_client:
        other = Engine(other_client)
        for msg in (P.CommitStore(engine=other.id, reservation=prep.reservation),
                    P.AbortStore(engine=other.id, reservation=prep.reservation)):
            with pytest.raises(ServerError) as ei:
                other_client.call(msg)
            assert_server_error(ei, E.UNKNOWN_RESERVATION, str(prep.reservation), f"engine {other.id}")
    assert owner.lookup(keys).hit_chunks == 0
    client.call(P.CommitStore(engine=owner.id, reservation=prep.reservation))
    owner.check(keys, owner.lookup(keys, policy="all", request="q"))
    assert_still_serving(server.endpoint)


def test_release_of_a_lease_not_held(server, client):
    eng = Engine(client)
    keys = fresh_keys(eng, 2)
    eng.store(keys)
    pinned = counters(client)["l1_pinned_objects"]
    with pytest.raises(ServerError) as ei:
        client.call(P.Release(engine=eng.id, lease=424242))
    assert_server_error(ei, E.UNKNOWN_LEASE, "424242")
    res = eng.lookup(keys)
    client.call(P.Release(engine=eng.id, lease=res.lease))
    with pytest.raises(ServerError) as ei:
        client.call(P.Release(engine=eng.id, lease=res.lease))
    assert_server_error(ei, E.UNKNOWN_LEASE, str(res.lease))
    assert counters(client)["l1_pinned_objects"] == pinned, "a second release must not unpin twice"
    # another engine cannot release (or retrieve) a lease it does not hold
    res = eng.lookup(keys, request="q")
    other = Engine(client)
    for msg in (P.Release(engine=other.id, lease=res.lease), P.Retrieve(engine=other.id, lease=res.lease)):
        with pytest.raises(ServerError) as ei:
            client.call(msg)
        assert_server_error(ei, E.UNKNOWN_LEASE, str(res.lease))
    assert_still_serving(server.endpoint)


def test_retrieve_with_format_shm(server, client):
    eng = Engine(client)
    keys = fresh_keys(eng, 1)
    eng.store(keys)
    res = eng.lookup(keys)
    with pytest.raises(ServerError) as ei:
        client.call(P.Retrieve(engine=eng.id, lease=res.lease, format="shm"))
    assert_server_error(ei, E.BAD_REQUEST, "shm")
    eng.check(keys, res)  # the lease is untouched
    assert_still_serving(server.endpoint)


# ---- keys, objects, layouts ----------------------------------------------------------------------

def test_keys_of_the_wrong_size(server, client):
    eng = Engine(client)
    keys = fresh_keys(eng, 3)
    bad = [keys[0], keys[1][:15], keys[2]]
    for msg in (P.Lookup(engine=eng.id, request="r", keys=bad),
                P.PrepareStore(engine=eng.id, request="r", keys=bad, objects=[(0, 0)])):
        with pytest.raises(ServerError) as ei:
            client.call(msg)
        assert_server_error(ei, E.BAD_REQUEST, "key 1 is 15 bytes", "16")
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("obj", [(2, 0), (-1, 0), (0, 4), (0, -1)])
def test_object_indices_out_of_range(server, client, obj):
    eng = Engine(client)
    keys = fresh_keys(eng, 2)
    before = counters(client)
    with pytest.raises(ServerError) as ei:
        client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=[(0, 0), obj]))
    assert_server_error(ei, E.BAD_REQUEST, f"chunk {obj[0]}, group {obj[1]}", "2 keys", "4 groups")
    after = counters(client)
    assert (after["reservations"], after["l1_objects"]) == (before["reservations"], before["l1_objects"]), \
        "nothing half-reserved"
    assert_still_serving(server.endpoint)


def test_duplicate_objects_in_one_prepare(server, client):
    eng = Engine(client)
    keys = fresh_keys(eng, 2)
    with pytest.raises(ServerError) as ei:
        client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=[(0, 0), (1, 2), (0, 0)]))
    assert_server_error(ei, E.BAD_REQUEST, "chunk 0, group 0", "twice")
    assert_still_serving(server.endpoint)


def test_negative_skip_chunks(server, client):
    eng = Engine(client)
    with pytest.raises(ServerError) as ei:
        client.call(P.Lookup(engine=eng.id, request="r", keys=fresh_keys(eng, 1), skip_chunks=-3))
    assert_server_error(ei, E.BAD_REQUEST, "-3")
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("field, value, needle", [
    ("page_bytes", 0, "page_bytes must be in 1..1099511627776, got 0"),
    ("block_tokens", -16, "block_tokens must be in 1..16777216, got -16"),
    ("kind", "chunked_local", "'chunked_local'"),
    ("kind", "sliding", "a sliding group's window must be in 1..4294967296 tokens, got 0"),
    ("window", 512, "recurrent groups have no window (got 512)"),
    ("dtype", "float7", "'float7'"),
])
def test_register_with_an_invalid_group(server, raw, field, value, needle):
    reg = as_dict(P.Register(layout=preset_layout("tiny-hybrid"), chunk_tokens=0))
    reg["layout"]["groups"][1][field] = value
    assert_error(raw.request(reg), E.BAD_MESSAGE, needle)
    assert_still_serving(server.endpoint)


def test_register_with_an_invalid_chunk_or_rank(server, client):
    layout = preset_layout("tiny-hybrid")
    block = layout.groups[0].block_tokens
    cases = [
        (P.Register(layout=layout, chunk_tokens=block + 1), (f"chunk_tokens {block + 1}", str(block))),
        (P.Register(layout=layout, chunk_tokens=-block), (f"{-block}",)),
        (P.Register(layout=layout, chunk_tokens=0, tp_rank=1), ("tp_rank 1", "[0, 1)")),
        (P.Register(layout=preset_layout("tiny-hybrid", tp=2), chunk_tokens=0, tp_rank=2), ("tp_rank 2", "[0, 2)")),
        (P.Register(layout=layout, chunk_tokens=0, tp_rank=-1), ("tp_rank -1",)),
    ]
    before = counters(client)
    for msg, needles in cases:
        with pytest.raises(ServerError) as ei:
            client.call(msg)
        assert_server_error(ei, E.LAYOUT, *needles)
    after = counters(client)
    assert (after["engines"], after["engines_registered"]) == (before["engines"], before["engines_registered"])
    assert_still_serving(server.endpoint)


def test_register_with_an_object_larger_than_l1(server_factory):
    server = server_factory(l1_gib=0.02)
    big = preset_layout("qwen3.6-27b")  # 51 MB objects in a 21 MB L1
    with CacheClient(server.endpoint, timeout_s=10) as client, pytest.raises(ServerError) as ei:
        client.call(P.Register(layout=big, chunk_tokens=784))
    assert_server_error(ei, E.LAYOUT, str(big.object_bytes(0, 784)), "does not fit")
    assert_still_serving(server.endpoint)


def test_error_counter_counts_every_refusal(server, raw):
    with CacheClient(server.endpoint, timeout_s=10) as c:
        before = counters(c)["errors"]
        for _ in range(3):
            raw.call([b"\xc1"])  # 0xc1 is never valid msgpack
        assert counters(c)["errors"] - before == 3
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_message_is_a_bad_message_and_the_server_survives(server, depth):
    raw = RawDealer(server.endpoint)
    try:
        nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
        for frame in (nested, b"\x82\xa1x" + nested + b"\xa2op\xa5stats",
                      msgspec.msgpack.encode({"op": "lookup", "engine": 1, "request": "r", "v": 1, "id": 7})[:-1]
                      + nested):
            reply, _ = raw.call([frame])
            assert isinstance(reply, P.Error) and reply.code == E.BAD_MESSAGE, reply
    finally:
        raw.close()
    assert alive(server.endpoint)


def test_duplicate_keys_are_refused_and_pin_counts_stay_exact(client):
    eng = Engine(client)
    keys = fresh_keys(eng, 4)
    eng.store(keys)
    before = counters(client)
    err = expect(E.BAD_REQUEST, lambda: eng.lookup([keys[0], keys[1], keys[0]]))
    assert "repeats key 0" in err.message
    expect(E.BAD_REQUEST, lambda: client.call(P.PrepareStore(engine=eng.id, request="r", keys=[keys[2]] * 2,
                                                             objects=[(0, 0), (1, 0)])))
    hit = eng.lookup(keys)
    assert hit.hit_chunks == 4
    client.call(P.Release(engine=eng.id, lease=hit.lease))
    after = counters(client)
    assert (after["l1_pinned_objects"], after["leases"]) == (before["l1_pinned_objects"], before["leases"])


def test_a_chunk_size_that_overflows_64_bits_is_a_layout_error(client):
    primes = (1_048_573, 1_048_571, 1_048_559, 1_048_549)  # lcm ~ 2**80
    groups = tuple(GroupLayout(kind="attention", layer_names=(f"l{i}",), page_bytes=64, block_tokens=p)
                   for i, p in enumerate(primes))
    err = expect(E.LAYOUT, lambda: client.call(P.Register(layout=ModelLayout(model="m", groups=groups),
                                                          chunk_tokens=0)))
    assert "chunk_tokens" in err.message


def expect_refused(c: CacheClient, msg: P.Message, field: str) -> None:
    with pytest.raises(ServerError) as ei:
        c.call(msg)
    assert ei.value.code == P.ErrorCode.BAD_MESSAGE and field in ei.value.message, ei.value


def test_ids_names_and_layouts_past_their_bounds_are_refused(server_factory):
    s = server_factory()
    tiny = preset_layout("tiny-hybrid")
    long = "x" * (MAX_NAME_CHARS + 1)
    with CacheClient(s.endpoint, timeout_s=10) as c:
        for msg, field in [
            (P.Register(layout=tiny, chunk_tokens=0, name=long), "$.name"),
            (P.Register(layout=tiny, chunk_tokens=0, salt=long), "$.salt"),
            (P.Register(layout=msgspec.structs.replace(tiny, model=long), chunk_tokens=0), "$.layout.model"),
            (P.Register(layout=msgspec.structs.replace(tiny, groups=(msgspec.structs.replace(
                tiny.groups[0], layer_names=(long,)),) + tiny.groups[1:]), chunk_tokens=0), "layer_names"),
        ]:
            expect_refused(c, msg, field)
    raw = RawDealer(s.endpoint)  # a layout our own client would not even build
    try:
        reg = msgspec.to_builtins(P.Register(layout=tiny, chunk_tokens=0))
        reg["layout"]["groups"][0]["layer_names"] = [f"l{i}" for i in range(MAX_LAYERS + 1)]
        reply = raw.request(reg)
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_MESSAGE, reply
        assert "layer_names" in reply.message, reply
    finally:
        raw.close()
    with CacheClient(s.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        keys = eng.keys(2, seed=4)
        eng.store(keys)
        expect_refused(c, P.Lookup(engine=eng.id, request=long, keys=keys), "$.request")
        expect_refused(c, P.PrepareStore(engine=eng.id, request=long, keys=keys, objects=[(0, 0)]), "$.request")
        expect_refused(c, P.EndSession(engine=eng.id, request=long), "$.request")
        ok = "r" * MAX_NAME_CHARS  # the bound itself is taken
        res = eng.lookup(keys, request=ok)
        assert res.hit_chunks == 2
        c.call(P.EndSession(engine=eng.id, request=ok))
        assert c.call(P.Stats())[0].counters["leases"] == 0
