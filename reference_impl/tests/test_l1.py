"""L1 object table on its own: states, pins, LRU order, and how eviction waits for L2 spills."""

from __future__ import annotations

import pytest
from hybridkv.arena import SLOT_ALIGN, Arena
from hybridkv.server.l1 import WAIT, L1Cache, State

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
    b.pins = 1           # b may not go
    e = l1.reserve(key(9), 0, NS, SLOT_ALIGN)
    assert e is not None and l1.get(c.oid) is None and l1.get(a.oid) is a and l1.get(b.oid) is b
    assert e.state is State.RESERVED and l1.evictions == 1


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
        e.pins = 1
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is None


def test_dirty_victims_are_spilled_before_their_slot_is_freed(arena):
    spilled = []
    l1 = L1Cache(arena, start_spill=spilled.append, l2_has=lambda e: e.in_l2)
    a, b, c, d = fill(l1, 4)
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) == WAIT
    assert spilled == [a] and a.spilling and a.evict_after_spill and l1.get(a.oid) is a
    l1.spill_finished(a, ok=True)            # the L2 write is done: now the slot is free
    assert l1.get(a.oid) is None
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not None


def test_clean_victims_go_first_and_a_vanished_l2_copy_makes_a_victim_dirty_again(arena):
    spilled = []
    in_l2 = set()
    l1 = L1Cache(arena, start_spill=spilled.append, l2_has=lambda e: e.oid in in_l2)
    a, b, c, d = fill(l1, 4)
    b.in_l2 = True
    in_l2.add(b.oid)
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not None  # b is clean: dropped at once, no spill
    assert l1.get(b.oid) is None and not spilled
    c.in_l2 = True  # L2 says it has c, but its copy has since been evicted from L2
    assert l1.reserve(key(10), 0, NS, SLOT_ALIGN) == WAIT
    assert spilled == [a] and c.in_l2 is False and l1.get(c.oid) is c  # c is dirty again, not dropped


def test_a_store_waits_for_spill_ahead_writes_instead_of_being_refused(arena):
    spilled = []
    l1 = L1Cache(arena, start_spill=spilled.append, l2_has=lambda e: e.in_l2)
    entries = fill(l1, 4)
    ahead = l1.spill_ahead(low_watermark=0.99, max_inflight=8, inflight=0)
    assert ahead == entries and all(e.spilling for e in entries)  # every object is being written to L2
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) == WAIT          # not None: those writes will free room
    l1.spill_finished(entries[0], ok=True)
    assert l1.reserve(key(9), 0, NS, SLOT_ALIGN) is not None
