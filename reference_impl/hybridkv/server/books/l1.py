"""L1: the object table over the shared-memory arena, with states, pins and LRU eviction.

An object is RESERVED while an engine writes it, LOADING while it is read back from L2, and READY once
visible. Only READY, unpinned objects that are not being spilled may be evicted. With an L2, a dirty
object (no copy in L2) is spilled before its slot is freed; the caller then waits for the spill.

Every evictable object sits in exactly one queue (clean, dirty, or stuck after a failed L2 write),
kept in LRU order. Victims are taken clean first, then dirty (after their spill), stuck last, so finding
a victim or the next object to spill is O(1): nothing scans the table per allocation. Pinned, spilling
and unready objects sit in no queue.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Iterator

import msgspec

from hybridkv.memory.arena import Arena, ExtentAllocator
from hybridkv.model.keys import ObjectKey
from hybridkv.server.machinery.lru import LruQueue, Queue, Segment
from hybridkv.server.machinery.table import KeySet, ObjectTable


class State(enum.Enum):
    RESERVED = "reserved"
    LOADING = "loading"
    READY = "ready"


class NoSlot(enum.Enum):
    """Why reserve() returned no entry."""
    WAIT = "wait"    # in-flight spills will free enough room: try again when they finish
    FULL = "full"    # nothing evictable: the rest is pinned, reserved or loading


class Entry(msgspec.Struct, gc=False, eq=False):
    """One object in L1. Not tracked by the cycle collector (gc=False): a server of a million objects walked them
    all in every full collection, the loop stopped meanwhile; nor are the queues and tables that hold it. Its
    references to its queue and segment are dropped when it leaves them (`LruQueue.remove`), so it is never part of
    a cycle that only the collector could free."""
    key: bytes
    group: int
    ns: bytes
    offset: int
    length: int
    state: State
    size: int = 0           # the slot's bytes (length rounded to the arena's alignment)
    pins: int = 0
    in_l2: bool = False
    spilling: bool = False
    evict_after_spill: bool = False
    failed_at: float = 0.0  # monotonic time of its last failed L2 write
    lent: int = 0           # loans of its bytes still out (loans.py): its slot is freed only once they are back
    queue: LruQueue[Entry] | None = None
    seg: Segment | None = None  # the queue's segment that holds it
    gone: bool = False      # dropped from the table (a failed prefetch, an abort)
    oid: ObjectKey = (b"", 0)  # (key, group), the table's key, set from them: kept, not rebuilt per queue move

    def __post_init__(self) -> None:
        self.oid = (self.key, self.group)

    @property
    def evictable(self) -> bool:
        return self.state is State.READY and self.pins == 0 and not self.spilling


class L1Cache:
    """Objects in the arena. `start_spill(entries)` writes dirty victims to L2 when an L2 exists."""

    def __init__(self, arena: Arena, policy: str = "lru",
                 start_spill: Callable[[list[Entry]], None] | None = None,
                 l2_has: Callable[[Entry], bool] | None = None):
        self.arena = arena
        self.alloc = ExtentAllocator(arena.size)
        self.policy = policy
        self._start_spill = start_spill
        self._l2_has = l2_has
        # sharded: one dict's resize at a million objects stops the loop (table.py)
        self._entries: ObjectTable[Entry] = ObjectTable()
        self.get: Callable[[ObjectKey], Entry | None] = self._entries.get
        self.get_many: Callable[[list[ObjectKey]], list[Entry | None]] = self._entries.get_many
        self._clean: LruQueue[Entry] = LruQueue(Queue.CLEAN)
        self._dirty: LruQueue[Entry] = LruQueue(Queue.DIRTY)
        self._stuck: LruQueue[Entry] = LruQueue(Queue.STUCK)
        self._ahead: LruQueue[Entry] = LruQueue(Queue.AHEAD)
        self.evictions = 0
        self.evicted_bytes = 0
        self.dropped_unspilled = 0  # evicted with no copy in L2 because L2 refused the write
        self.pending_free = 0  # bytes that in-flight evicting spills will free
        self._pinned = 0
        # the keys of READY objects, per (namespace, group): a lookup asks "is every chunk of this prompt READY in
        # my namespace?" in C, and a bytes key hashes once (its hash is kept), a (key, group) tuple at every question
        self.ready_keys: dict[tuple[bytes, int], KeySet] = {}
        self._ready = 0
        self._used = 0
        self.lent_dropped = 0  # slots of objects dropped while lent, freed when their last loan is back

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def pieces(self) -> Iterator[list[Entry]]:
        """The entries in pieces, a shard's snapshot at a time (`ObjectTable.pieces`)."""
        return self._entries.pieces()

    @property
    def stuck_objects(self) -> int:
        return len(self._stuck)

    # ---- queues ----------------------------------------------------------------------------------

    def _unqueue(self, e: Entry) -> None:
        q = e.queue
        if q is not None:
            q.remove(e)

    def _enqueue(self, e: Entry, q: LruQueue, young: bool = True) -> None:
        if e.queue is q:
            q.move(e, young)
            return
        self._unqueue(e)
        q.add(e, young)

    def _place(self, e: Entry, young: bool = True) -> None:
        """Put an entry in the queue its state calls for (or none)."""
        # `not e.evictable`, spelled out: every object of every released lease passes here
        if e.pins or e.spilling or e.gone or e.state is not State.READY:
            self._unqueue(e)
        elif self._start_spill is None or e.in_l2:
            self._enqueue(e, self._clean, young)
        elif e.failed_at:
            self._enqueue(e, self._stuck, young)
        else:
            self._enqueue(e, self._dirty, young)

    # ---- state changes -----------------------------------------------------------------------------

    def reserve(self, key: bytes, group: int, ns: bytes, length: int,
                state: State = State.RESERVED) -> Entry | NoSlot:
        """A new entry with a slot of `length` bytes, evicting if needed; or why there is none."""
        off = self._allocate(length)
        if isinstance(off, NoSlot):
            return off
        e = Entry(key, group, ns, off, length, state, self.alloc.rounded(max(length, 1)))
        self._entries.put(e)
        self._used += e.size
        return e

    def make_ready(self, e: Entry) -> None:
        if e.state is not State.READY and not e.gone:
            self._ready += 1
            ready = self.ready_keys.get((e.ns, e.group))
            if ready is None:
                ready = self.ready_keys[(e.ns, e.group)] = KeySet()
            ready.add(e.key)
        e.state = State.READY
        self._place(e)

    def touch(self, e: Entry) -> None:
        """A hit: LRU moves it to the young end of its queue; FIFO keeps insertion order."""
        if self.policy == "lru" and e.queue is not None:
            e.queue.move(e)

    def pin(self, e: Entry) -> None:
        self.pin_all((e,))

    def unpin(self, e: Entry) -> None:
        self.unpin_all((e,))

    def pin_all(self, entries: Iterable[Entry]) -> None:
        """Pin each entry once (a lookup's whole hit in one call: the loop is the per-object cost)."""
        for e in entries:
            if e.pins == 0:
                self._pinned += 1
            e.pins += 1
            q = e.queue
            if q is not None:
                q.remove(e)

    def unpin_all(self, entries: Iterable[Entry]) -> None:
        """Drop one pin of each entry; an entry left unpinned goes back to its eviction queue, young end."""
        clean, ready = self._clean, State.READY
        clean_when_ready = self._start_spill is None  # without L2 every evictable object is clean
        for e in entries:
            if e.pins <= 0:
                raise AssertionError(f"unpin of object (group {e.group}) that holds no pin")
            e.pins -= 1
            if e.pins == 0 and not e.gone:  # a detached entry left the pinned count when it left the table
                self._pinned -= 1
                if e.queue is None and e.state is ready and not e.spilling and (clean_when_ready or e.in_l2):
                    clean.add(e)  # _place's most common case, spelled out: to the clean queue's young end
                else:
                    self._place(e)

    def drop(self, e: Entry) -> None:
        """Free an entry's slot now, or when its last loan is back (`give_back`). The caller guarantees no engine
        writes or reads it any more."""
        assert not e.spilling, "an entry being spilled cannot be freed"
        self.detach(e)
        if e.lent:
            self.lent_dropped += 1
        else:
            self.alloc.free(e.offset, e.length)

    def lend(self, entries: Iterable[Entry]) -> None:
        """Their bytes are read outside the loop from now on: their slots are not freed until given back. The
        objects stay evictable (they leave the table as any other) and are no pinned objects: a reader that
        never finishes holds slots, never the cache's choice of what to keep. Only READY and LOADING objects
        (a lease's) are lent: a reservation's slot, which `ObjectStore.discard` may quarantine, never is."""
        for e in entries:
            e.lent += 1

    def give_back(self, entries: Iterable[Entry]) -> None:
        """A loan of `entries` is back: free the slots of those dropped meanwhile that no other loan holds."""
        for e in entries:
            e.lent -= 1
            if not e.lent and e.gone:
                self.lent_dropped -= 1
                self.alloc.free(e.offset, e.length)

    def detach(self, e: Entry) -> None:
        """Forget an entry but keep its extent allocated (the caller frees it later)."""
        if self._entries.remove(e):
            self._used -= e.size
            if e.state is State.READY:
                self._ready -= 1
                ready = self.ready_keys[(e.ns, e.group)]
                ready.discard(e.key)
                if not ready:  # a namespace whose objects are all gone leaves nothing behind
                    del self.ready_keys[(e.ns, e.group)]
            if e.pins:
                self._pinned -= 1
        e.gone = True
        self._unqueue(e)

    def _evict(self, e: Entry) -> None:
        self.drop(e)
        self.evictions += 1
        self.evicted_bytes += e.length

    def loaded(self, e: Entry) -> None:
        """An L2 read into `e` finished: it is READY and L2 holds its bytes."""
        e.in_l2 = True
        self.make_ready(e)

    def spill_finished(self, e: Entry, ok: bool) -> None:
        """An L2 write of `e` ended; frees it now if it was evicted while spilling."""
        e.spilling = False
        e.in_l2 = e.in_l2 or ok
        e.failed_at = 0.0 if ok else time.monotonic()
        if e.evict_after_spill:
            e.evict_after_spill = False
            self.pending_free -= e.size
            if ok and e.evictable and not e.gone:
                self._evict(e)
                return
            # a failed write keeps the object (STUCK); it is dropped only when nothing else can make room
        if not e.gone:
            self._place(e)

    def retry_stuck(self, older_than: float) -> int:
        """Objects whose L2 write failed before `older_than` become dirty again (spilled on the next pass)."""
        stuck = self._stuck
        n = 0
        while stuck:
            e = stuck.oldest()
            if e.failed_at > older_than:
                break
            e.failed_at = 0.0
            self._place(e, young=False)
            n += 1
        return n

    # ---- allocation --------------------------------------------------------------------------------

    def _allocate(self, length: int) -> int | NoSlot:
        need = self.alloc.rounded(max(length, 1))
        if need > self.alloc.size:
            return NoSlot.FULL
        off = self.alloc.alloc(length)
        if off is not None:
            return off
        # Clean victims from the old end first: no copy needed, so no wait on L2.
        clean = self._clean
        while clean:
            e = clean.oldest()
            if self._l2_has is not None and e.in_l2 and not self._l2_has(e):
                e.in_l2 = False  # L2 dropped its copy since: it is dirty again, and the oldest
                self._place(e, young=False)
                continue
            self._evict(e)
            off = self.alloc.alloc(length)
            if off is not None:
                return off
        if self._start_spill is None:
            return NoSlot.FULL
        # Only dirty victims left: copy the oldest to L2; the caller waits until that frees their slots.
        free = self.alloc.free_bytes
        if self.pending_free and free + self.pending_free >= need:
            return NoSlot.WAIT
        batch: list[Entry] = []
        dirty = self._dirty
        while dirty and (not batch or free + self.pending_free < need):
            e = dirty.oldest()
            self._unqueue(e)
            e.spilling = e.evict_after_spill = True
            self.pending_free += e.size
            batch.append(e)
        if batch:
            self._start_spill(batch)
        # Spill-ahead writes in flight free nothing by themselves: have them free their slots when done,
        # so a store waits for them instead of being refused while L1 is merely busy writing to L2.
        ahead = self._ahead
        while ahead and free + self.pending_free < need:
            e = ahead.oldest()
            self._unqueue(e)
            e.evict_after_spill = True
            self.pending_free += e.size
        if self.pending_free > 0:
            return NoSlot.WAIT
        # L2 refuses writes (a full or broken disk): serve on as an L1-only cache. The oldest object whose
        # write failed goes, and is counted (the object store logs the count): never a silent loss.
        stuck = self._stuck
        while stuck:
            e = stuck.oldest()
            self._evict(e)
            self.dropped_unspilled += 1
            off = self.alloc.alloc(length)
            if off is not None:
                return off
        return NoSlot.FULL

    def spill_ahead(self, low_watermark: float, max_objects: int, max_bytes: int | None = None) -> list[Entry]:
        """Dirty LRU objects to copy to L2 now, so later evictions find clean victims and never wait.

        At most `max_objects` objects, and no more once `max_bytes` bytes are taken (at least one)."""
        if self._start_spill is None:
            return []
        target = low_watermark * self.alloc.size
        clean = self.alloc.free_bytes + self.pending_free + self._clean.bytes + self._ahead.bytes
        out: list[Entry] = []
        taken = 0
        dirty = self._dirty
        while dirty and clean < target and len(out) < max_objects and (max_bytes is None or taken < max_bytes):
            e = dirty.oldest()
            e.spilling = True
            self._enqueue(e, self._ahead)
            clean += e.size
            taken += e.length
            out.append(e)
        return out

    def take_unspilled(self) -> list[Entry]:
        """Every READY object L2 lacks, marked as being spilled (a flush at shutdown writes them all)."""
        out = [e for e in self._entries.values() if e.state is State.READY and not e.spilling and not e.in_l2]
        for e in out:
            self._unqueue(e)
            e.spilling = True
        return out

    def usage(self) -> dict[str, int]:
        return {"l1_objects": len(self._entries), "l1_bytes_used": self._used, "l1_capacity_bytes": self.alloc.size,
                "l1_free_bytes": self.alloc.free_bytes, "l1_pinned_objects": self._pinned,
                "l1_unready_objects": len(self._entries) - self._ready, "l1_evictions": self.evictions,
                "l1_evicted_bytes": self.evicted_bytes, "l1_kept_after_l2_failure": self.stuck_objects,
                "l1_dropped_unspilled": self.dropped_unspilled, "l1_lent_dropped_slots": self.lent_dropped}
