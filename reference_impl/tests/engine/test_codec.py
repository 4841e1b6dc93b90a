"""The seed's pickle / torch.save formats: every dtype a layout may name round-trips, nothing else decodes."""

from __future__ import annotations

import io
import os
import pickle

import msgspec
import numpy as np
import pytest
from hybridkv.model.layout import DTYPE_BYTES
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from serverkit import Engine

torch = pytest.importorskip("torch")
from hybridkv.baselines.codec import PayloadError, decode_tensor, encode_tensor  # noqa: E402

FP8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("fmt", ["pickle", "torch_save"])
@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_every_layout_dtype_round_trips(fmt, dtype):
    """All 256 byte values (NaN and inf patterns of fp8 included) come back bit-exact with their dtype."""
    raw = torch.arange(4096, dtype=torch.int32).remainder(256).to(torch.uint8)
    t = raw.view(getattr(torch, dtype))
    back = decode_tensor(fmt, encode_tensor(fmt, t))
    assert back.dtype == t.dtype
    assert torch.equal(back.view(torch.uint8), raw)


@pytest.mark.parametrize("payload", [
    pickle.dumps(os.system),
    pickle.dumps(io.BytesIO),
    pickle.dumps(torch.load),
    pickle.dumps({"a": 1}),
    b"\x80\x05junk",
])
def test_pickle_refuses_anything_but_a_tensor(payload):
    with pytest.raises(PayloadError):
        decode_tensor("pickle", payload)


def test_pickle_refuses_torch_names_that_are_not_dtypes():
    """The dtype allowance is for dtype objects only: torch.load by the v3 opcode path stays refused."""
    good = encode_tensor("pickle", torch.zeros(4, dtype=torch.float8_e5m2))
    bad = good.replace(b"float8_e5m2", b"load\x00\x00\x00\x00\x00\x00\x00")  # same length, other name
    with pytest.raises(PayloadError):
        decode_tensor("pickle", bad)


@pytest.mark.parametrize("fmt", ["pickle", "torch_save"])
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pages_through_the_server(client, fmt, dtype):
    """An fp8 layout stored and retrieved in a legacy format: accepted, byte-exact (was bad_payload)."""
    base = preset_layout("tiny-hybrid")
    layout = msgspec.structs.replace(base, groups=tuple(msgspec.structs.replace(g, dtype=dtype) for g in base.groups))
    eng = Engine(client, layout=layout)
    keys = eng.keys(2)
    objs = [(c, g) for c in range(2) for g in range(len(layout.groups))]
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="r", keys=keys, objects=objs))
    frames = [encode_tensor(fmt, torch.from_numpy(eng.payload(keys[s.chunk], s.group, s.length).copy())
                            .view(getattr(torch, dtype))) for s in prep.slots]
    done, _ = client.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format=fmt), frames)
    assert done.objects == len(objs)
    res = eng.lookup(keys, policy="all")
    eng.check(keys, res)
    rep, out = client.call(P.Retrieve(engine=eng.id, lease=res.lease, format=fmt))
    for o, f in zip(rep.objects, out, strict=True):
        t = decode_tensor(fmt, f)
        assert t.dtype == getattr(torch, dtype)
        assert np.array_equal(t.view(torch.uint8).numpy(), eng.payload(keys[o.chunk], o.group, o.length))
