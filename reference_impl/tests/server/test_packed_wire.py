"""Bulk integers travel packed (issue 23: no client delays another's request by more than 50 ms).

msgspec builds one Python object per msgpack array element before any check of ours runs, so one hostile 8 MiB
frame of (chunk, group) pairs held the loop 0.37 s in decode and one of 4M one-block lists 2.5 s. PrepareStore's
objects and CommitStore / Retrieve block ids are int32 bytes; a list form is still taken from hand-written
clients, its length checked before any element is built. Against real server processes: the packed form stores
what the listed one does; over-long lists, packed fields of a wrong length and out-of-range values get one-line
errors, and the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridkv.server.front.launch import ServerProcess
from hybridkv.wire import protocol as P
from serverkit import Engine, RawDealer, module_server
from test_bad_input import assert_error, assert_still_serving

E = P.ErrorCode


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module's refusals (each test checks that it keeps serving after its own)."""
    with module_server() as s:
        yield s


@pytest.fixture
def raw(server):
    d = RawDealer(server.endpoint)
    yield d
    d.close()


def test_pack_round_trip_and_range():
    vals = [0, 1, -1, 2**31 - 1, -(2**31), 12345]
    assert list(P.unpack_ints(P.pack_ints(vals))) == vals
    assert len(P.pack_pairs([(1, 2), (3, 4)])) == 16
    with pytest.raises(ValueError, match="int32"):
        P.pack_ints([2**31])
    m = P.PrepareStore(engine=1, request="r", keys=[b"k" * 16], objects=[(0, 1), (5, 3)])
    assert m.objects == P.pack_pairs([(0, 1), (5, 3)]) and list(m.pairs()) == [0, 1, 5, 3] and m.n_objects == 2
    # the listed form and the packed form are one message on the wire
    assert P.encode(m) == P.encode(P.PrepareStore(engine=1, request="r", keys=[b"k" * 16],
                                                  objects=P.pack_pairs([(0, 1), (5, 3)])))
    c = P.CommitStore(engine=1, reservation=2, blocks=[[4, 5], [6]])
    assert list(P.unpack_ints(c.blocks)) == [4, 5, 6]
    assert P.decode_request(P.encode(c)) == c


def prepare_dict(eng: int, keys: list[bytes], objects) -> dict:
    return {"op": "prepare_store", "id": 7, "engine": eng, "request": "r", "keys": keys, "objects": objects}


@pytest.mark.parametrize("field,value,needle", [
    ("objects", [[0, 0]] * (P.MAX_LISTED + 1), f"length <= {P.MAX_LISTED}"),
    ("objects", b"\0" * 12, "multiple of 8 bytes"),
    ("objects", [[0, 2**40]], "int32"),
])
def test_prepare_objects_refused_at_decode(server, client, raw, field, value, needle):
    eng = Engine(client)
    reply = raw.request({**prepare_dict(eng.id, eng.keys(2), []), field: value})
    assert_error(reply, E.BAD_MESSAGE, needle)
    assert reply.id == 7
    assert_still_serving(server.endpoint)


@pytest.mark.parametrize("op,extra", [("commit_store", {"reservation": 1}), ("retrieve", {"lease": 1})])
@pytest.mark.parametrize("blocks,needle", [
    ([[1]] * (1 << 21), f"length <= {P.MAX_LISTED}"),  # 2M one-block lists (4 MiB): 1.2 s of decode before
    ([list(range(P.MAX_LISTED_BLOCKS + 1))], f"length <= {P.MAX_LISTED_BLOCKS}"),
    (b"\0" * 6, "multiple of 4 bytes"),
])
def test_block_lists_refused_at_decode(server, client, raw, op, extra, blocks, needle):
    eng = Engine(client)
    reply = raw.request({"op": op, "id": 9, "engine": eng.id, **extra, "blocks": blocks})
    assert_error(reply, E.BAD_MESSAGE, needle)
    assert reply.id == 9
    assert_still_serving(server.endpoint)


def test_too_many_keys_refused_at_decode(server, client, raw):
    eng = Engine(client)
    reply = raw.request({"op": "lookup", "id": 3, "engine": eng.id, "request": "r", "keys": [b""] * (P.MAX_KEYS + 1)})
    assert_error(reply, E.BAD_MESSAGE, f"length <= {P.MAX_KEYS}")
    assert_still_serving(server.endpoint)


def test_packed_prepare_reserves_what_the_listed_one_does(server, client, raw):
    """The same objects, listed by a hand-written client (a raw msgpack list) and packed: the same slots."""
    eng = Engine(client)
    reg = raw.request(P.Register(layout=eng.layout, chunk_tokens=eng.chunk_tokens))  # the raw socket's own engine
    assert isinstance(reg, P.Registered), reg
    eng.id = reg.engine
    keys_a, keys_b = eng.keys(3, seed=71), eng.keys(3, seed=72)
    pairs = [(c, g) for c in (2, 0, 1) for g in (3, 0)]
    listed = raw.request(prepare_dict(eng.id, keys_a, [list(p) for p in pairs]))
    packed = raw.request(prepare_dict(eng.id, keys_b, P.pack_pairs(pairs)))
    for r in (listed, packed):
        assert isinstance(r, P.Prepared), r
        assert [(s.chunk, s.group) for s in r.slots] == pairs and not r.refused and not r.present
    assert [s.length for s in listed.slots] == [s.length for s in packed.slots]
    # a packed pair outside the request is named as a listed one is
    reply = raw.request(prepare_dict(eng.id, keys_a, P.pack_pairs([(0, 0), (3, 1)])))
    assert_error(reply, E.BAD_REQUEST, "chunk 3, group 1", "3 keys")
    assert_still_serving(server.endpoint)
