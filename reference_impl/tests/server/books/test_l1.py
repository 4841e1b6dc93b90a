"""L1 object table on its own: states, pins, LRU order, and how eviction waits for L2 spills."""

from __future__ import annotations

import pytest
from hybridkv.memory.arena import SLOT_ALIGN, Arena
from hybridkv.server.books.l1 import L1Cache, NoSlot, State

NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def arena(tmp_path):
    a = Arena(4 * SLOT_ALIGN, tmp_path)
    yield a
    a.close()


def fill(l1: L1Cache, n: int) -> list:
    out = []
    for i in range(n):
        e = l1.reserve(key(i), 0, NS, SLOT_ALIGN)
        l1.make_ready(e)
        out.append(e)
    return out


def test_lru_evicts_the_oldest_unpinned_ready_object(arena):
    l1 = L1Cache(arena)
    a, b, c, d = fill(l1, 4)
    l1.touch(a)          # a is now the youngest
    l1.pin(b)            # b may not go
    e = l1.reserve(key(9), 0, NS, SLOT_ALIGN)
    assert e is not None and l1.get(c.oid) is None and l1.get(a.oid) is a and l1.get(b.oid) is b
    assert e.state is State.RESERVED and l1.evictions == 1


def test_a_lent_object_is_evicted_but_its_slot_is_reused_only_once_every_loan_is_back(arena):
    """Reply frames still being sent read a lent object's slot (server/books/loans.py): the object leaves the table as
    any other (evicting it frees nothing yet, so eviction goes on to the next), but no store gets its slot until
    the last loan of it is given back."""
    l1 = L1Cache(arena)
    a, b, c, d = fill(l1, 4)
    l1.lend([a])
    l1.lend([a, b])
    e = l1.reserve(key(9), 0, NS, SLOT_ALIGN)  # evicts a and b (their slots stay taken), then c
    assert e.offset == c.offset and [l1.get(x.oid) for x in (a, b, c)] == [None] * 3 and l1.get(d.oid) is d
    assert l1.lent_dropped == 2 and l1.evictions == 3 and l1.usage()["l1_pinned_objects"] == 0
    l1.give_back([a, b])  # b's last loan: its slot is free; a is still lent once
    assert l1.alloc.free_bytes == SLOT_ALIGN and l1.lent_dropped == 1
    assert l1.reserve(key(10), 0, NS, SLOT_ALIGN).offset == b.offset
    l1.give_back([a])
    assert l1.alloc.free_bytes == SLOT_ALIGN and l1.lent_dropped == 0
    assert l1.reserve(key(11), 0, NS, SLOT_ALIGN).offset == a.offset


def test_fifo_ignores_hits(arena):
    l1 = L1Cache(arena, policy="fifo")
    a, *_ = fill(l1, 4)
    l1.touch(a)
    l1.reserve(key(9), 0, NS, SLOT_ALIGN)
    assert l1.get(a.oid) is None


def test_everything_pinned_or_unready_refuses(arena):
    l1 = L1Cache(arena)
    entries = fill(l1, 3)
    l1.reserve(key(8), 0, NS, SLOT_ALIGN)  # RESERVED: never evictable
    for e in entries:
        l1.pin(e)
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is NoSlot.FULL
    l1.unpin(entries[0])
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not NoSlot.FULL
    with pytest.raises(AssertionError):
        l1.unpin(entries[0])  # a pin count never goes below zero


def test_dirty_victims_are_spilled_before_their_slot_is_freed(arena):
    spilled = []
    l1 = L1Cache(arena, start_spill=spilled.extend, l2_has=lambda e: e.in_l2)
    a, b, c, d = fill(l1, 4)
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is NoSlot.WAIT
    assert spilled == [a] and a.spilling and a.evict_after_spill and l1.get(a.oid) is a
    l1.spill_finished(a, ok=True)            # the L2 write is done: now the slot is free
    assert l1.get(a.oid) is None
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not None


def test_clean_victims_go_first_and_a_vanished_l2_copy_makes_a_victim_dirty_again(arena):
    spilled = []
    in_l2 = set()
    l1 = L1Cache(arena, start_spill=spilled.extend, l2_has=lambda e: e.oid in in_l2)
    a, b, c, d = fill(l1, 4)
    in_l2.add(b.oid)
    l1.spill_finished(b, ok=True)  # b is written to L2: clean
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not None  # b is clean: dropped at once, no spill
    assert l1.get(b.oid) is None and not spilled
    l1.spill_finished(c, ok=True)  # L2 took c, but its copy has since been evicted from L2
    assert l1.reserve(key(10), 0, NS, SLOT_ALIGN) is NoSlot.WAIT
    assert spilled == [c] and c.in_l2 is False and l1.get(c.oid) is c  # c is dirty again, not dropped


def test_a_store_waits_for_spill_ahead_writes_instead_of_being_refused(arena):
    spilled = []
    l1 = L1Cache(arena, start_spill=spilled.extend, l2_has=lambda e: e.in_l2)
    entries = fill(l1, 4)
    ahead = l1.spill_ahead(low_watermark=0.99, max_objects=8)
    assert ahead == entries and all(e.spilling for e in entries)  # every object is being written to L2
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is NoSlot.WAIT          # not FULL: those writes will free room
    l1.spill_finished(entries[0], ok=True)
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not None


def test_a_failed_spill_keeps_the_object_until_nothing_else_makes_room_and_counts_its_loss(arena):
    spilled = []
    l1 = L1Cache(arena, start_spill=spilled.extend, l2_has=lambda e: e.in_l2)
    entries = fill(l1, 4)
    for e in l1.spill_ahead(low_watermark=0.99, max_objects=8):
        l1.spill_finished(e, ok=False)  # L2 refused every write (a full disk)
    assert l1.stuck_objects == 4 and all(l1.get(e.oid) is e for e in entries) and l1.dropped_unspilled == 0
    assert l1.retry_stuck(older_than=0.0) == 0  # too recent: not retried in a loop
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) not in (NoSlot.FULL, NoSlot.WAIT)  # an L1-only cache goes on
    assert l1.get(entries[0].oid) is None and l1.dropped_unspilled == 1  # the oldest went, and is counted
    assert l1.retry_stuck(older_than=float("inf")) == 3 and l1.stuck_objects == 0
    assert l1.reserve(key(10), 0, NS, SLOT_ALIGN) is NoSlot.WAIT  # dirty again: spilled before eviction


def test_pinned_objects_at_the_old_end_are_not_scanned_per_allocation(tmp_path):
    a = Arena(2048 * SLOT_ALIGN, tmp_path)
    try:
        l1 = L1Cache(a)
        entries = fill(l1, 2048)
        for e in entries[:2000]:
            l1.pin(e)  # the 2000 oldest are pinned: a victim search that scans would walk them every time
        for i in range(48):
            assert l1.reserve(key(10_000 + i), 0, NS, SLOT_ALIGN) not in (NoSlot.FULL, NoSlot.WAIT)
        assert l1.evictions == 48 and all(l1.get(e.oid) is e for e in entries[:2000])
        assert len(l1._clean) == 0  # only unpinned READY objects are queued
    finally:
        a.close()


def test_spill_ahead_stops_at_its_byte_bound_so_large_objects_spread_over_the_io_threads(arena):
    l1 = L1Cache(arena, start_spill=lambda batch: None, l2_has=lambda e: e.in_l2)
    entries = fill(l1, 4)
    first = l1.spill_ahead(low_watermark=0.99, max_objects=8, max_bytes=SLOT_ALIGN + 1)
    assert first == entries[:2]                        # the second object crosses the bound: two, not four
    assert l1.spill_ahead(low_watermark=0.99, max_objects=8, max_bytes=1) == entries[2:3]  # at least one
    assert l1.spill_ahead(low_watermark=0.99, max_objects=8) == entries[3:]


def test_flush_batches_hold_many_small_objects_or_few_large_ones(arena, tmp_path):
    from hybridkv.server.books.objects import SPILL_BATCH, SPILL_BATCH_BYTES, spill_batches

    small = fill(L1Cache(arena), 4)
    assert list(spill_batches(small)) == [small]       # tiny objects share one worker hand-off
    many = small * (SPILL_BATCH // 2)                  # 2 * SPILL_BATCH objects of one slot each
    assert [len(b) for b in spill_batches(many)] == [SPILL_BATCH, SPILL_BATCH]
    big_len = SPILL_BATCH_BYTES // 2 - SLOT_ALIGN      # three of them cross the byte bound
    big_arena = Arena(6 * (big_len + SLOT_ALIGN), tmp_path)
    try:
        l1 = L1Cache(big_arena)
        big = [l1.reserve(key(i), 0, NS, big_len) for i in range(6)]
        assert [[e.oid for e in b] for b in spill_batches(big)] == [[e.oid for e in big[:3]], [e.oid for e in big[3:]]]
    finally:
        big_arena.close()
    assert list(spill_batches([])) == []


def ready_in_table(l1: L1Cache) -> dict[tuple[bytes, int], set[bytes]]:
    out: dict[tuple[bytes, int], set[bytes]] = {}
    for e in l1.entries():
        if e.state is State.READY:
            out.setdefault((e.ns, e.group), set()).add(e.key)
    return out


def ready_sets(l1):
    return {nsg: ks.keys() for nsg, ks in l1.ready_keys.items()}


def test_ready_keys_follow_every_state_change(arena):
    # a lookup answers "is every chunk READY in my namespace?" from ready_keys: it must name exactly the READY
    # objects, and keep no empty set behind (one per namespace and group ever seen would grow without bound)
    l1 = L1Cache(arena)
    a, b = fill(l1, 2)
    loading = l1.reserve(key(5), 1, NS, SLOT_ALIGN, state=State.LOADING)
    reserved = l1.reserve(key(6), 0, NS, SLOT_ALIGN)
    assert not isinstance(loading, NoSlot) and not isinstance(reserved, NoSlot)
    assert ready_sets(l1) == ready_in_table(l1) == {(NS, 0): {key(0), key(1)}}
    l1.loaded(loading)                     # LOADING -> READY
    l1.pin_all([a, a, b])
    l1.unpin_all([a, b])                   # b, unpinned, is now younger than the loaded object
    e = l1.reserve(key(9), 0, NS, SLOT_ALIGN)  # full: evicts the oldest unpinned READY object
    assert not isinstance(e, NoSlot) and l1.get(loading.oid) is None and a.pins == 1
    l1.drop(reserved)                      # never READY
    l1.detach(a)                           # gone while pinned: the unpin after it changes no count
    l1.unpin(a)
    l1.make_ready(e)
    assert ready_sets(l1) == ready_in_table(l1) == {(NS, 0): {key(1), key(9)}}
    assert l1.usage()["l1_unready_objects"] == 0 and l1.usage()["l1_pinned_objects"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_segmented_queue_keeps_the_order_one_ordered_dict_keeps(monkeypatch, seed):
    """LruQueue in segments of 8 (merging under 4): 20,000 random adds at either end, moves to either end and
    removes (runs of them, so segments empty, go sparse and merge) keep exactly the order, count and bytes of
    one OrderedDict; every entry's segment is one of the queue's and holds it; segments stay few."""
    import gc
    import random
    from collections import OrderedDict

    from hybridkv.server.books.l1 import Entry
    from hybridkv.server.machinery import lru
    from hybridkv.server.machinery.lru import LruQueue, Queue

    monkeypatch.setattr(lru, "SEGMENT", 8)
    monkeypatch.setattr(lru, "_SPARSE", 4)
    rng = random.Random(seed)
    q, ref = LruQueue(Queue.CLEAN), OrderedDict()
    pool = [Entry(key(i), 0, NS, 0, 1, State.READY, size=1 + i % 3) for i in range(400)]
    for step in range(20_000):
        e = rng.choice(pool)
        young = rng.random() < 0.8
        if e.queue is None:
            q.add(e, young)
            ref[e.oid] = e
            ref.move_to_end(e.oid, last=young)
        elif rng.random() < 0.5:
            q.move(e, young)
            ref.move_to_end(e.oid, last=young)
        else:
            q.remove(e)
            del ref[e.oid]
        if step % 97 == 0 or step > 19_900:
            got = [x.oid for x in q]
            assert got == list(ref), step
            assert len(q) == len(ref) and q.bytes == sum(x.size for x in ref.values())
            assert all(any(x.seg is s for s in q.segments()) and x in x.seg for x in ref.values())
            assert all(q.segs[i] for i in range(len(q.segs) - 1)), "an empty segment other than the youngest"
            assert len(q.segs) <= 2 * len(ref) // 8 + 3, (len(q.segs), len(ref))
            assert len(q.front) < 8 and sum(map(len, q.segments())) == len(ref)
            assert not any(gc.is_tracked(s) for s in q.segments()), "a segment the cycle collector walks"
            if ref:
                assert q.oldest() is next(iter(ref.values()))
