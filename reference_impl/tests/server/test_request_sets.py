"""The hit rule with a large request's sets in segments (table.SegmentedSet, a Lookup's and a Prefetch's) answers
what it answers with plain sets: the same length and the same objects of another namespace collected, with the
misses in many segments. A server in this process, its handlers called directly."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.front.cli import parse
from hybridkv.server.front.loop import CacheServer
from hybridkv.server.machinery import table
from hybridkv.server.machinery.table import SegmentedSet
from hybridkv.server.ops.hitrule import hit_length
from hybridkv.wire import protocol as P

LAYOUT = ModelLayout(model="sets", groups=(
    GroupLayout(kind="attention", layer_names=("a",), page_bytes=2, block_tokens=1),
    GroupLayout(kind="recurrent", layer_names=("r",), page_bytes=2, block_tokens=1),
    GroupLayout(kind="sliding", layer_names=("s",), page_bytes=2, block_tokens=1, window=5),
))
N = 200


@pytest.fixture
def srv(tmp_path):
    s = CacheServer(parse([f"--endpoint=ipc://{tmp_path}/s.sock", "--l1-gib=0.01", f"--l1-dir={tmp_path}"]))
    sent: list[P.Message] = []
    s.ctx.send = lambda ident, rid, reply, frames: sent.append(reply)

    def call(msg: P.Message) -> P.Message:
        out = s._dispatch(b"c", msg, ())
        while out is None and not sent:
            s._run_parked()
        return out[0] if out else sent.pop()

    yield s, call
    s.close()


def test_the_hit_rule_answers_the_same_with_its_sets_in_segments(srv, monkeypatch):
    s, call = srv
    reg = call(P.Register(layout=LAYOUT, chunk_tokens=1))
    other = call(P.Register(layout=LAYOUT, chunk_tokens=1, salt="other"))
    keys = chunk_keys(reg.namespace, np.arange(N), 1)
    rng = random.Random(5)
    # the recurrent states of the last chunks held under another namespace only (the walk down collects each of
    # them), and a few scattered objects
    holes = {(c, 1) for c in range(N - 30, N)} | {(c, g) for c in range(N) for g in range(3) if rng.random() < 0.004}
    for eng, objects in ((reg, [(c, g) for c in range(N) for g in range(3) if (c, g) not in holes]),
                         (other, sorted(holes))):  # the holes held under another namespace: foreign objects
        prep = call(P.PrepareStore(engine=eng.engine, request="s", keys=keys, objects=objects))
        call(P.CommitStore(engine=eng.engine, reservation=prep.reservation))
    eng = s.sessions.engines[reg.engine]
    monkeypatch.setattr(table, "KEYSET_SEGMENT", 3)
    oids = [(keys[c], g) for c in range(N) for g in range(3)]
    most = 0
    for trial in range(60):
        missing = set(rng.sample(oids, rng.choice([0, 1, 2, 7, 40, 150])))
        seg_missing: SegmentedSet = SegmentedSet()
        for o in missing:
            seg_missing.add(o)
        assert len(seg_missing.segs) == max(1, -(-len(missing) // 3))
        policy = rng.choice(["boundary", "all"])
        lo = rng.randrange(N // 2)
        plain_foreign: set = set()
        seg_foreign: SegmentedSet = SegmentedSet()
        for _ in range(3):  # asked again, as a turned lookup's passes do: the same objects found again
            n = hit_length(s.ctx, eng, keys[lo:], policy, missing, plain_foreign)
            assert hit_length(s.ctx, eng, keys[lo:], policy, seg_missing, seg_foreign) == n, trial
        assert seg_foreign.keys() == plain_foreign and len(seg_foreign) == len(plain_foreign)
        assert bool(seg_foreign) == bool(plain_foreign)
        most = max(most, len(seg_foreign.segs))
    assert most > 5  # the objects of another namespace were collected in many segments too
