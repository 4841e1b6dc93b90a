"""The L1's tables in pieces (server/machinery/table.py): they answer as one dict and one set would, and no
piece grows past its share, which is what bounds a resize's stop of the loop."""

from __future__ import annotations

import gc
import os
import random

import pytest
from hybridkv.server.books.l1 import Entry, State
from hybridkv.server.machinery import table
from hybridkv.server.machinery.lru import LruQueue, Queue
from hybridkv.server.machinery.table import KeySet, ObjectTable, SegmentedSet
from hybridkv.server.ops import turns


def entry(k: bytes, g: int) -> Entry:
    return Entry(k, g, b"ns", 0, 1, State.READY)


@pytest.mark.parametrize("seed", range(4))
def test_object_table_answers_as_one_dict(seed):
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(300)]
    t, d = ObjectTable(), {}
    for _ in range(5000):
        e = entry(rng.choice(keys), rng.randrange(4))
        if rng.random() < 0.6:
            t.put(e)
            d[e.oid] = e
        else:
            old = d.get(e.oid)
            if old is not None and rng.random() < 0.5:
                assert t.remove(old) and not t.remove(old)  # once
                del d[e.oid]
            else:
                assert not t.remove(e)  # not the entry the table holds under that oid
        assert len(t) == len(d)
    oids = [(k, g) for k in keys[:50] for g in range(4)]
    assert t.get_many(oids) == [d.get(o) for o in oids] == [t.get(o) for o in oids]
    assert sorted(map(id, t.values())) == sorted(map(id, d.values()))


def test_object_table_shards_fill_evenly():
    # a shard's resize is what a piece of a large prepare can meet: bounded only while none holds far more
    # than its share (chunk keys are hashes; bytes keep theirs)
    t = ObjectTable()
    n = 64 * 2000
    for _ in range(n // 4):
        k = os.urandom(16)
        for g in range(4):
            t.put(entry(k, g))
    assert sorted(t._groups) == [0, 1, 2, 3] and len(t) == n
    for g in range(4):  # the shards of each group
        sizes = [len(s) for s in t._groups[g]]
        assert len(sizes) == table.SHARDS and sum(sizes) == n // 4
        assert max(sizes) < 1.25 * n / 4 / table.SHARDS


@pytest.mark.parametrize("segment", [3, 1 << 17])
def test_keyset_answers_as_one_set(monkeypatch, segment):
    monkeypatch.setattr(table, "KEYSET_SEGMENT", segment)
    rng = random.Random(segment)
    keys = [rng.randbytes(8) for _ in range(40)]
    ks, s = KeySet(), set()
    for _ in range(3000):
        k = rng.choice(keys)
        if k in s:
            ks.discard(k)
            s.discard(k)
        else:
            ks.add(k)
            s.add(k)
        assert ks.keys() == s and len(ks) == len(s) and bool(ks) == bool(s) and (k in ks) == (k in s)
        ask = rng.sample(keys, 5)
        assert ks.issuperset(ask) == s.issuperset(ask)
        assert ks.issuperset(sorted(s)[:7])
        assert all(len(seg) <= segment for seg in ks.segs) and (len(ks.segs) == 1 or all(ks.segs))


@pytest.mark.parametrize("segment", [3, 1 << 17])
def test_a_request_set_answers_as_one_set(monkeypatch, segment):
    # what a large request collects per object (misses, objects of another namespace): added again and again, as a
    # set's add (a lookup's passes find the same objects again), asked `in` through its view
    monkeypatch.setattr(table, "KEYSET_SEGMENT", segment)
    rng = random.Random(segment + 1)
    oids = [(rng.randbytes(8), g) for _ in range(30) for g in range(3)]
    ss: SegmentedSet[tuple[bytes, int]] = SegmentedSet()
    s: set[tuple[bytes, int]] = set()
    assert not ss and not s and not ss.view() and len(ss) == 0
    most = 1
    for _ in range(3000):
        o = rng.choice(oids)
        if rng.random() < 0.8:
            ss.add(o)
            s.add(o)
        else:
            ss.discard(o)
            s.discard(o)
        view = ss.view()
        assert ss.keys() == s and len(ss) == len(s) and bool(ss) == bool(s) == bool(view)
        assert all((x in ss) == (x in view) == (x in s) for x in rng.sample(oids, 10))
        assert all(len(seg) <= segment for seg in ss.segs) and (len(ss.segs) == 1 or all(ss.segs))
        assert (view is ss.segs[0]) == (len(ss.segs) == 1)
        most = max(most, len(ss.segs))
    assert most > 1 or segment > len(oids)  # the small segment did grow past one


def test_lists_done_with_are_emptied_a_piece_per_turn_and_counts_taken_before():
    # what a large request leaves behind (a lease's locations, a reservation's slots) is freed in pieces after
    # its answer: `empty` yields between pieces once the turn is over and leaves every list empty
    clock = turns.Clock()  # until 0: every turn is over at once
    lists = [list(range(5000)), [], list(range(3 * turns.SLICE_OBJECTS))]
    pieces = sum(1 for _ in turns.empty(lists, clock))
    assert all(not lst for lst in lists)
    assert pieces == (5000 // turns.SLICE_OBJECTS) + 3 - 1  # a yield between pieces, none after the last


def test_l1_entries_are_not_tracked_by_the_cycle_collector():
    # a full collection walked every entry (350 ms of CPU at 1M objects); untracked, an entry must never be in a
    # cycle that only the collector could free: leaving its queue drops its links to the queue and segment
    e, q = entry(b"k" * 16, 0), LruQueue(Queue.CLEAN)
    q.add(e)
    assert not gc.is_tracked(e) and e.queue is q and e.seg is not None
    q.remove(e)
    assert e.queue is None and e.seg is None


def test_the_tables_that_hold_l1_objects_are_not_tracked_either():
    """A full collection walks every item of every tracked dict: the object table's shards and the queues'
    segments stay untracked while objects of brand-new (still tracked) oid tuples enter, move and leave them, so a
    full collection at 1M objects walks none of them (`microbench/gc_pause`). (The READY key sets are sets, which
    are always tracked: `table.SegmentedSet` says why.)"""
    gc.disable()  # no collection may untrack anything meanwhile: the containers must never be tracked at all
    try:
        t, q = ObjectTable(), LruQueue(Queue.CLEAN)
        es = [entry(os.urandom(16), g) for _ in range(300) for g in range(3)]
        assert gc.is_tracked(es[0].oid)  # what a dict keyed by oid would have been tracked for
        for i, e in enumerate(es):
            t.put(e)
            q.add(e, young=i % 3 != 0)
        for e in es[::4]:
            q.move(e, young=False)
        for e in es[::5]:
            t.remove(e)
            q.remove(e)
        containers = [*t._all_shards(), *q.segments()]
        assert len(containers) > table.SHARDS and not any(gc.is_tracked(c) for c in containers)
    finally:
        gc.enable()
