"""The L1's eviction queues (l1.py): entries oldest first, kept in segments so that no table grows past a size
whose resize stops the server's loop."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from hybridkv.keys import ObjectKey

if TYPE_CHECKING:
    from hybridkv.server.l1 import Entry


class Queue(enum.Enum):
    """The eviction queues (an entry that is pinned, spilling or not READY sits in none)."""
    CLEAN = 1     # evictable at once: L2 holds a copy, or there is no L2
    DIRTY = 2     # must be written to L2 before its slot is freed
    STUCK = 3     # its last L2 write failed: kept in L1, retried later, evicted last (and then counted)
    AHEAD = 4     # a spill-ahead write is in flight


# Entries per segment of a queue. CPython resizes a dict in one step, walking every entry: an OrderedDict of 699k
# entries stopped the loop 141 ms as it grew, one of 1.4M 258 ms (2-core VM). A segment of 16,384 resizes in ~1 ms.
SEGMENT = 16_384
_SPARSE = SEGMENT // 2  # a segment (not the youngest) under this many entries merges into a neighbour


class LruQueue:
    """One eviction queue: entries oldest first, and the slot bytes they hold.

    Kept as segments, each an OrderedDict of about SEGMENT entries, oldest segment first: an entry enters the
    youngest (or, taken back to the old end, the oldest), leaves wherever it sits (`Entry.seg`). A segment left
    empty goes; one left sparse is merged into a neighbour with room, so the segments stay at most about twice as
    many as the entries need (a segment keeps its table's memory until it goes)."""
    __slots__ = ("kind", "segs", "n", "bytes")

    def __init__(self, kind: Queue):
        self.kind = kind
        self.segs: deque[OrderedDict[ObjectKey, Entry]] = deque([OrderedDict()])
        self.n = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def oldest(self) -> Entry:
        for seg in self.segs:  # only the youngest segment may be empty
            if seg:
                return next(iter(seg.values()))
        raise KeyError("oldest() of an empty queue")

    def add(self, e: Entry, young: bool = True) -> None:
        """`e`, in no queue, at the young (or the old) end."""
        segs = self.segs
        if young:
            seg = segs[-1]
            if len(seg) >= SEGMENT:
                seg = OrderedDict()
                segs.append(seg)
            seg[e.oid] = e
        else:
            seg = segs[0]
            if len(seg) >= SEGMENT:
                seg = OrderedDict()
                segs.appendleft(seg)
            seg[e.oid] = e
            seg.move_to_end(e.oid, last=False)
        e.seg, e.queue = seg, self
        self.n += 1
        self.bytes += e.size

    def remove(self, e: Entry) -> None:
        seg = e.seg
        assert seg is not None
        del seg[e.oid]
        e.seg = e.queue = None
        self.n -= 1
        self.bytes -= e.size
        if len(seg) < _SPARSE and seg is not self.segs[-1]:
            self._sparse(seg)

    def move(self, e: Entry, young: bool = True) -> None:
        """`e`, in this queue, to the young (or the old) end."""
        if young and e.seg is self.segs[-1]:
            e.seg.move_to_end(e.oid)
            return
        self.remove(e)
        self.add(e, young)

    def _sparse(self, seg: OrderedDict[ObjectKey, Entry]) -> None:
        """`seg` (not the youngest) fell under _SPARSE entries: drop it when empty, else merge it into the older
        neighbour (its entries after that one's) or the younger (before that one's) where the result stays
        within 2 x SEGMENT; else it stays (both neighbours are full)."""
        segs = self.segs
        i = next(j for j, s in enumerate(segs) if s is seg)
        if not seg:
            del segs[i]
            return
        if i > 0 and len(segs[i - 1]) + len(seg) <= 2 * SEGMENT:
            into = segs[i - 1]
            for oid, e in seg.items():
                into[oid] = e
                e.seg = into
        elif len(segs[i + 1]) + len(seg) <= 2 * SEGMENT:
            into = segs[i + 1]
            for oid, e in reversed(seg.items()):
                into[oid] = e
                into.move_to_end(oid, last=False)
                e.seg = into
        else:
            return
        del segs[i]
