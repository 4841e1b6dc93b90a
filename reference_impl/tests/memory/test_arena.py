"""The arena file and its slot allocator."""

from __future__ import annotations

import os
import random
import stat

import pytest
from hybridkv.memory.arena import SLOT_ALIGN, Arena, ArenaError, ExtentAllocator, SortedStarts, map_arena


def test_allocator_against_a_byte_map():
    """Random allocs and frees: no overlap, alignment kept, coalescing gives the space back."""
    size = 256 * SLOT_ALIGN
    a = ExtentAllocator(size)
    used = bytearray(size // SLOT_ALIGN)
    live: list[tuple[int, int]] = []
    rng = random.Random(5)
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off, n = live.pop(rng.randrange(len(live)))
            a.free(off, n)
            for i in range(off // SLOT_ALIGN, (off + a.rounded(n)) // SLOT_ALIGN):
                used[i] = 0
        else:
            n = rng.randint(1, 12 * SLOT_ALIGN)
            off = a.alloc(n)
            if off is None:
                assert a.largest_free() < a.rounded(n)
                continue
            assert off % SLOT_ALIGN == 0 and off + n <= size
            cells = range(off // SLOT_ALIGN, (off + a.rounded(n)) // SLOT_ALIGN)
            assert not any(used[i] for i in cells), "two live extents overlap"
            for i in cells:
                used[i] = 1
            live.append((off, n))
        assert a.free_bytes == size - SLOT_ALIGN * sum(used)
    for off, n in live:
        a.free(off, n)
    assert a.free_bytes == size and a.largest_free() == size  # fully coalesced


@pytest.mark.parametrize("seed", range(3))
def test_sorted_starts_keep_the_order_of_one_sorted_list(monkeypatch, seed):
    """The free extents' starts in runs of 4 (split past 8): random adds and removes keep exactly one sorted list's
    items, every run sorted, none empty, none past twice the run length."""
    monkeypatch.setattr(SortedStarts, "RUN", 4)
    rng = random.Random(seed)
    s, ref = SortedStarts(), set()
    for step in range(4000):
        x = rng.randrange(300)
        if x in ref:
            s.remove(x)
            ref.discard(x)
        else:
            s.add(x)
            ref.add(x)
        if step % 50 == 0:
            assert list(s) == sorted(ref)
            assert all(run and len(run) <= 8 and run == sorted(run) for run in s._runs)
            assert s._maxes == [run[-1] for run in s._runs]
    with pytest.raises(ValueError, match="not held"):
        s.remove(1000)


def test_allocator_refuses_foreign_extents():
    a = ExtentAllocator(16 * SLOT_ALIGN)
    with pytest.raises(ValueError, match="never allocated"):
        a.free(3, 10)


def test_arena_file_is_private_and_unlinked(tmp_path):
    arena = Arena(1 << 20, tmp_path)
    assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600
    arena.view(4096, 8)[:] = b"hybridkv"
    other = map_arena(arena.path, 1 << 20, writable=False)
    assert other[4096:4104] == b"hybridkv"  # another process's mapping sees the bytes
    other.close()
    with pytest.raises(ArenaError, match="announced"):
        map_arena(arena.path, 1 << 21)
    arena.close()
    assert not arena.path.exists()


def test_arena_larger_than_the_mount_is_refused(tmp_path):
    with pytest.raises(ArenaError, match=f"cannot be held: {tmp_path} has .* GiB free"):
        Arena(1 << 60, tmp_path)
