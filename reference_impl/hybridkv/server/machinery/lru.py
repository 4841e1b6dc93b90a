"""LRU queues kept in segments so that no table grows past a size whose resize stops the server's loop: the L1's
eviction queues (l1.py), and `LruIndex`, a table of objects in one such queue (the L2 adapters' indexes)."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from hybridkv.model.keys import ObjectKey
from hybridkv.server.machinery.table import Keyed, ObjectTable


class Queue(enum.Enum):
    """The eviction queues (an entry that is pinned, spilling or not READY sits in none)."""
    CLEAN = 1     # evictable at once: L2 holds a copy, or there is no L2
    DIRTY = 2     # must be written to L2 before its slot is freed
    STUCK = 3     # its last L2 write failed: kept in L1, retried later, evicted last (and then counted)
    AHEAD = 4     # a spill-ahead write is in flight


# Entries per segment of a queue. CPython resizes a dict in one step, walking every entry: one queue of a million
# entries stops the loop for the whole walk as it grows; a segment this size resizes in a stop no request feels.
SEGMENT = 16_384
_SPARSE = SEGMENT // 2  # a segment (not the youngest) under this many entries merges into a neighbour


Segment = dict[Any, None]
"""A piece of a queue: a plain dict of its entries (as keys, hashed by identity: eq=False) in insertion order. Not an
OrderedDict, nor one keyed by oid: the cycle collector tracks every OrderedDict and walks its entries in each full
collection (a cost that grows with the queued entries), and a dict stays tracked from the moment a (key,
group) tuple, still tracked when new, enters it to the next full collection. A dict whose keys are untracked
entries (gc=False) and whose values are None is never tracked."""


class Queued(Keyed, Protocol):
    """What a queue holds: an object (its oid), its bytes, and the queue and segment it sits in (the queue's to set;
    `LruQueue.remove` drops them, so an entry leaves no cycle behind)."""
    @property
    def size(self) -> int: ...
    queue: LruQueue[Any] | None
    seg: Segment | None


E = TypeVar("E", bound=Queued)


class LruQueue(Generic[E]):
    """One eviction queue: entries oldest first, and the slot bytes they hold.

    Kept as segments (`Segment`), each of about SEGMENT entries, oldest segment first: an entry enters the youngest
    and leaves wherever it sits (`Entry.seg`). One taken back to the old end enters `front`, a segment read
    backwards (its last entry is the queue's oldest; a plain dict cannot put one before its first), which joins
    the segments at the old end once it holds SEGMENT entries. A segment left empty goes; one left sparse is merged
    into a neighbour with room, so the segments stay at most about twice as many as the entries need (a segment
    keeps its table's memory until it goes)."""
    __slots__ = ("kind", "front", "segs", "n", "bytes")

    def __init__(self, kind: Queue | None = None):
        self.kind = kind
        self.front: Segment = {}
        self.segs: deque[Segment] = deque([{}])
        self.n = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[E]:
        """The entries, oldest first (the queue not to be changed while walked)."""
        yield from reversed(self.front)
        for seg in self.segs:
            yield from seg

    def segments(self) -> list[Segment]:
        """Every segment that holds the queue's entries (the front first)."""
        return [self.front, *self.segs]

    def oldest(self) -> E:
        if self.front:
            return next(reversed(self.front))
        for seg in self.segs:  # only the youngest segment may be empty
            if seg:
                return next(iter(seg))
        raise KeyError("oldest() of an empty queue")

    def add(self, e: E, young: bool = True) -> None:
        """`e`, in no queue, at the young (or the old) end."""
        if young:
            seg = self.segs[-1]
            if len(seg) >= SEGMENT:
                seg = {}
                self.segs.append(seg)
        else:
            seg = self.front
        seg[e] = None
        e.seg, e.queue = seg, self
        self.n += 1
        self.bytes += e.size
        if not young and len(seg) >= SEGMENT:
            self._settle_front()

    def remove(self, e: E) -> None:
        seg = e.seg
        assert seg is not None
        del seg[e]
        e.seg = e.queue = None
        self.n -= 1
        self.bytes -= e.size
        if len(seg) < _SPARSE and seg is not self.segs[-1] and seg is not self.front:
            self._sparse(seg)

    def move(self, e: E, young: bool = True) -> None:
        """`e`, in this queue, to the young (or the old) end."""
        seg = e.seg
        if young and seg is self.segs[-1]:
            del seg[e]  # a plain dict's end: taken out and put back
            seg[e] = None
            return
        self.remove(e)
        self.add(e, young)

    def _settle_front(self) -> None:
        """The front, full, becomes the oldest of the segments (its entries in the order it is read)."""
        seg: Segment = dict.fromkeys(reversed(self.front))
        for e in seg:
            e.seg = seg
        self.segs.appendleft(seg)
        self.front = {}

    def _sparse(self, seg: Segment) -> None:
        """`seg` (not the youngest) fell under _SPARSE entries: drop it when empty, else merge it into the older
        neighbour (its entries after that one's), or the younger neighbour into it, where the result stays within
        2 x SEGMENT; else it stays (both neighbours are full)."""
        segs = self.segs
        i = next(j for j, s in enumerate(segs) if s is seg)
        if not seg:
            del segs[i]
            return
        if i > 0 and len(segs[i - 1]) + len(seg) <= 2 * SEGMENT:
            into, gone = segs[i - 1], i
        elif len(segs[i + 1]) + len(seg) <= 2 * SEGMENT:
            into, gone = seg, i + 1
        else:
            return
        for e in segs[gone]:
            into[e] = None
            e.seg = into
        del segs[gone]


class _Links(msgspec.Struct, gc=False, eq=False, kw_only=True):
    """The queue and segment that hold an entry, set by the queue (keyword-only, after a subclass's fields)."""
    queue: LruQueue[Any] | None = None
    seg: Segment | None = None


class Indexed(_Links):
    """An object in an `LruIndex` (an L2 adapter's subclass adds what it knows of the object). Not compared by
    value (an index tells its entries apart by identity, and its segments hash them so), and, as the L1's entries,
    not tracked by the cycle collector (gc=False, inherited): hundreds of thousands of L2 entries as dataclasses
    made every full collection walk them all, under the GIL, while the loop waited. So an entry is never left in a
    cycle that only the collector could free: one that leaves its index is unlinked (`LruQueue.remove`), or its
    segment emptied (`LruIndex.clear`, an index freed)."""
    oid: ObjectKey
    size: int  # the bytes that the index's `bytes` counts

    @property
    def key(self) -> bytes:
        return self.oid[0]

    def __repr__(self) -> str:  # without the links: a segment holds thousands of entries
        fields = (f for f in self.__struct_fields__ if f not in _Links.__struct_fields__)
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f)!r}' for f in fields)})"


class LruIndex(Generic[E]):
    """A table of objects by oid (`ObjectTable`) kept in one LRU queue, least recently used first: what the L2
    adapters index their objects with. It was one OrderedDict of every object, which CPython resizes in one step,
    under the GIL, so the loop waited as long as the resize took; here no dict holds more than a shard of
    the table or a segment of the queue. An entry belongs to one index: `put` links it in, `pop` unlinks it."""
    __slots__ = ("table", "queue", "get")

    def __init__(self) -> None:
        self.table: ObjectTable[E] = ObjectTable()
        self.queue: LruQueue[E] = LruQueue()
        # the entry of an oid, or None: the table's own (asked for every object a lookup misses in L1)
        self.get: Callable[[ObjectKey], E | None] = self.table.get

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return self.queue.n > 0

    def __contains__(self, oid: ObjectKey) -> bool:
        return self.table.get(oid) is not None

    @property
    def bytes(self) -> int:
        """The sum of the entries' `size`."""
        return self.queue.bytes

    def put(self, e: E) -> E | None:
        """`e` (in no index) at the young end, in place of the entry of its oid, which is returned."""
        old = self.pop(e.oid)
        self.table.put(e)
        self.queue.add(e)
        return old

    def pop(self, oid: ObjectKey) -> E | None:
        """Take the entry of `oid` out and return it (None when there is none)."""
        e = self.table.get(oid)
        if e is not None:
            self.table.remove(e)
            self.queue.remove(e)
        return e

    def touch(self, e: E) -> None:
        """`e`, held, to the young end (a hit)."""
        self.queue.move(e)

    def pop_oldest(self) -> E:
        """Take the least recently used entry out and return it (KeyError when empty)."""
        e = self.queue.oldest()
        self.table.remove(e)
        self.queue.remove(e)
        return e

    def values(self) -> Iterator[E]:
        """The entries, least recently used first (not to be changed while walked)."""
        return iter(self.queue)

    def clear(self) -> None:
        """Take every entry out: a fresh table and queue at once, then the old segments emptied one at a time
        (each in one short C call; one OrderedDict.clear() of a million entries is one long stop). Callers with a
        lock that the loop waits on swap in a new index under it and clear the old one outside it."""
        queue = self.queue
        self.table, self.queue = ObjectTable(), LruQueue()
        self.get = self.table.get
        _empty(queue)

    def __del__(self) -> None:
        # the entries link to the queue, not to the index: emptied here, they and the segments go with it
        _empty(self.queue)


def _empty(queue: LruQueue[Any]) -> None:
    """Empty the queue's segments, one C call each: an entry that outlives its segment's emptying (held elsewhere)
    links only to an empty segment and a queue with none, so no cycle is left that only the collector could free."""
    front, queue.front = queue.front, {}
    front.clear()
    segs = queue.segs
    while segs:
        segs.popleft().clear()
