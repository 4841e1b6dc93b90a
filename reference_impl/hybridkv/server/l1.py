"""L1: the object table over the shared-memory arena, with states, pins and LRU eviction.

An object is RESERVED while an engine writes it, LOADING while it is read back from L2, and READY once
visible. Only READY, unpinned objects that are not being spilled may be evicted. With an L2, a dirty
object (no copy in L2) is spilled before its slot is freed; the caller then waits for the spill.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridkv.arena import Arena, ExtentAllocator

ObjectId = tuple[bytes, int]  # (chunk key, group)


class State(enum.Enum):
    RESERVED = "reserved"
    LOADING = "loading"
    READY = "ready"


WAIT = "wait"  # an allocation that will succeed once in-flight spills finish


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    group: int
    ns: bytes
    offset: int
    length: int
    state: State
    pins: int = 0
    in_l2: bool = False
    spilling: bool = False
    evict_after_spill: bool = False
    spill_failed: bool = False  # its last L2 write failed: spill-ahead leaves it to eviction

    @property
    def oid(self) -> ObjectId:
        return (self.key, self.group)

    @property
    def evictable(self) -> bool:
        return self.state is State.READY and self.pins == 0 and not self.spilling


class L1Cache:
    """Objects in the arena. `start_spill(entry)` is called for dirty victims when an L2 exists."""

    def __init__(self, arena: Arena, policy: str = "lru",
                 start_spill: Callable[[Entry], None] | None = None,
                 l2_has: Callable[[Entry], bool] | None = None):
        self.arena = arena
        self.alloc = ExtentAllocator(arena.size)
        self.policy = policy
        self._start_spill = start_spill
        self._l2_has = l2_has
        self._entries: dict[ObjectId, Entry] = {}
        self._order: OrderedDict[ObjectId, Entry] = OrderedDict()  # READY objects, oldest first
        self.evictions = 0
        self.evicted_bytes = 0
        self.pending_free = 0  # bytes that in-flight evicting spills will free

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, oid: ObjectId) -> Entry | None:
        return self._entries.get(oid)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def touch(self, e: Entry) -> None:
        """A hit: LRU moves it to the young end; FIFO keeps insertion order."""
        if self.policy == "lru" and e.oid in self._order:
            self._order.move_to_end(e.oid)

    def reserve(self, key: bytes, group: int, ns: bytes, length: int,
                state: State = State.RESERVED) -> Entry | str | None:
        """A new entry with a slot of `length` bytes, evicting if needed; WAIT, or None if it cannot fit."""
        off = self._allocate(length)
        if off is None or off == WAIT:
            return off
        e = Entry(key, group, ns, off, length, state)
        self._entries[e.oid] = e
        return e

    def make_ready(self, e: Entry) -> None:
        e.state = State.READY
        self._order[e.oid] = e
        self._order.move_to_end(e.oid)

    def drop(self, e: Entry) -> None:
        """Free an entry's slot now. The caller guarantees no engine writes or reads it any more."""
        assert not e.spilling, "an entry being spilled cannot be freed"
        self.detach(e)
        self.alloc.free(e.offset, e.length)

    def detach(self, e: Entry) -> None:
        """Forget an entry but keep its extent allocated (the caller frees it later)."""
        del self._entries[e.oid]
        self._order.pop(e.oid, None)

    def evict(self, e: Entry) -> None:
        self.drop(e)
        self.evictions += 1
        self.evicted_bytes += e.length

    def spill_finished(self, e: Entry, ok: bool) -> None:
        """An L2 write of `e` ended; frees it now if it was evicted while spilling."""
        e.spilling = False
        e.in_l2 = e.in_l2 or ok
        e.spill_failed = not ok
        if e.evict_after_spill:
            e.evict_after_spill = False
            self.pending_free -= self.alloc.rounded(e.length)
            if e.evictable and self._entries.get(e.oid) is e:
                self.evict(e)

    def clean(self, e: Entry) -> bool:
        """True when L2 still holds e's bytes (L2 may have evicted or dropped its copy since the spill)."""
        if e.in_l2 and self._l2_has is not None and not self._l2_has(e):
            e.in_l2 = False
        return e.in_l2

    def _allocate(self, length: int) -> int | str | None:
        need = self.alloc.rounded(max(length, 1))
        if need > self.alloc.size:
            return None
        off = self.alloc.alloc(length)
        if off is not None:
            return off
        # Clean victims first (no copy needed, so no wait on L2, which may be busy with other engines'
        # reads); among them same-size ones first: freeing one is guaranteed to fit. Each victim is found
        # from the old end of the LRU order, so a store that needs k slots looks at about k entries.
        dirty = self._start_spill is not None
        for exact in (True, False):
            while True:
                victim = next((e for e in self._order.values()
                               if e.evictable and (not exact or self.alloc.rounded(e.length) == need)
                               and (not dirty or self.clean(e))), None)
                if victim is None:
                    break
                self.evict(victim)
                off = self.alloc.alloc(length)
                if off is not None:
                    return off
        if not dirty:
            return None
        # Only dirty victims left: copy the oldest to L2, and the caller waits until that frees their slots.
        for exact in (True, False):
            for e in self._order.values():
                if not e.evictable or (exact and self.alloc.rounded(e.length) != need):
                    continue
                if self.pending_free and self.alloc.free_bytes + self.pending_free >= need:
                    return WAIT
                e.spilling = e.evict_after_spill = True
                self.pending_free += self.alloc.rounded(e.length)
                self._start_spill(e)
        # Spill-ahead writes in flight free nothing by themselves: have them free their slots when done,
        # so a store waits for them instead of being refused while L1 is merely busy writing to L2.
        for e in self._order.values():
            if e.spilling and not e.evict_after_spill and e.pins == 0 and e.state is State.READY:
                if self.pending_free and self.alloc.free_bytes + self.pending_free >= need:
                    break
                e.evict_after_spill = True
                self.pending_free += self.alloc.rounded(e.length)
        return WAIT if self.pending_free > 0 else None

    def spill_ahead(self, low_watermark: float, max_inflight: int, inflight: int) -> list[Entry]:
        """Dirty LRU objects to copy to L2 now, so later evictions find clean victims and never wait."""
        target = low_watermark * self.alloc.size
        clean = self.alloc.free_bytes + self.pending_free
        out: list[Entry] = []
        for e in self._order.values():
            if clean >= target or inflight + len(out) >= max_inflight:
                break
            if not e.evictable or e.spill_failed:
                continue  # retrying a failed write here would spin on a full or broken L2
            if e.in_l2:
                clean += self.alloc.rounded(e.length)
            else:
                e.spilling = True
                out.append(e)
                clean += self.alloc.rounded(e.length)
        return out

    def usage(self) -> dict[str, int]:
        pinned = sum(1 for e in self._entries.values() if e.pins)
        reserved = sum(1 for e in self._entries.values() if e.state is not State.READY)
        used = sum(self.alloc.rounded(e.length) for e in self._entries.values())
        return {"l1_objects": len(self._entries), "l1_bytes_used": used, "l1_capacity_bytes": self.alloc.size,
                "l1_free_bytes": self.alloc.free_bytes, "l1_pinned_objects": pinned,
                "l1_unready_objects": reserved, "l1_evictions": self.evictions,
                "l1_evicted_bytes": self.evicted_bytes}
