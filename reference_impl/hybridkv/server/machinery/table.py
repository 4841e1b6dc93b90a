"""The L1's tables, kept in pieces so that none grows past a size whose resize stops the server's loop: the object
table, (key, group) -> Entry, and the sets of READY keys a lookup asks.

CPython grows a dict in one step that walks every entry: the L1 table as one dict stopped the loop for the whole
walk at a million objects, the moment a prepare crossed a power of two.
Here each of a group's SHARDS dicts holds about 1/SHARDS of its objects, chosen by the key's hash (a chunk key is
already a hash; bytes keep theirs, so choosing costs no hashing). The shards fill evenly, so they cross their
powers of two within a few thousand objects of each other, not in the same one: code that inserts many
objects reads the clock between pieces of at most a few hundred (`store.TURN_OBJECTS`), and a piece meets one
shard's resize, 1/SHARDS of the whole.

A set of READY keys (one per namespace and group) is asked "does it hold all of these keys?" in C, which a
sharded set would turn into a question per shard. So it is kept whole up to KEYSET_SEGMENT keys, which is all an
honest layout's group ever holds (a 1 TiB L1 holds 43,000 objects of a group of Qwen3.6-27B TP8 ranks), and
grows in further segments past it: a set of millions of keys resizes in one long step. The same SegmentedSet holds
what a Lookup or Prefetch collects per object (its misses, objects of another namespace): nothing in a
request's size bounds those across its passes, and a set of (key, group) pairs grown large in one piece of a turn
stops the loop far past a turn, where in segments each piece is short.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from hybridkv.model.keys import ObjectKey

SHARDS = 64  # a piece of a prepare meets one shard's resize, 1/SHARDS of one dict's
_MASK = SHARDS - 1
KEYSET_SEGMENT = 1 << 17  # a set this size resizes in a stop no request feels
PIECE = 256  # entries a walk in pieces (`ObjectTable.pieces`) hands out at once: small next to a loop turn


class Keyed(Protocol):
    """What a table holds: an object's key, and its oid (key, group), which the table finds it by."""
    @property
    def key(self) -> bytes: ...
    @property
    def oid(self) -> ObjectKey: ...


E = TypeVar("E", bound=Keyed)
K = TypeVar("K")


class ObjectTable(Generic[E]):
    """A dict of objects by oid (the L1's entries; in `lru.LruIndex`, an L2 adapter's), kept per group in SHARDS
    dicts by chunk key. `get_many` is the bulk question of a lookup (one pass, no call per object).

    Keyed by the chunk key (bytes), not by the (key, group) tuple: a dict is tracked by the cycle collector from the
    moment a tuple still tracked (every new one is, until a young collection) enters it to the next full
    collection, which then walks all its entries (1M objects: most of a full collection's time), while a dict of
    bytes keys and untracked entries (gc=False) is never tracked."""
    __slots__ = ("_groups", "_n")

    def __init__(self) -> None:
        self._groups: dict[int, list[dict[bytes, E]]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def get(self, oid: ObjectKey) -> E | None:
        shards = self._groups.get(oid[1])
        return None if shards is None else shards[hash(oid[0]) & _MASK].get(oid[0])

    def get_many(self, oids: list[ObjectKey]) -> list[E | None]:
        groups = self._groups
        return [None if (s := groups.get(g)) is None else s[hash(k) & _MASK].get(k) for k, g in oids]

    def _shard(self, e: E) -> dict[bytes, E] | None:
        shards = self._groups.get(e.oid[1])
        return None if shards is None else shards[hash(e.key) & _MASK]

    def put(self, e: E) -> None:
        """`e` under its oid (in place of the entry there, as a dict's item assignment)."""
        shard = self._shard(e)
        if shard is None:
            shards = self._groups[e.oid[1]] = [{} for _ in range(SHARDS)]
            shard = shards[hash(e.key) & _MASK]
        n = len(shard)
        shard[e.key] = e
        self._n += len(shard) - n

    def remove(self, e: E) -> bool:
        """Take `e` out if the table holds it (not another entry of its oid); whether it did."""
        shard = self._shard(e)
        if shard is None or shard.get(e.key) is not e:
            return False
        del shard[e.key]
        self._n -= 1
        return True

    def _all_shards(self) -> Iterator[dict[bytes, E]]:
        """Shard by shard, each over every group: a key's objects of all groups come close together (one shard of
        each group holds them), as they sit in the arena, so a walk that frees them frees neighbours, which
        coalesce (group by group, a Clear's free list grew longer on its way)."""
        groups = list(self._groups.values())
        for j in range(SHARDS):
            for shards in groups:
                yield shards[j]

    def values(self) -> Iterator[E]:
        for shard in self._all_shards():
            yield from shard.values()

    def pieces(self, size: int = PIECE) -> Iterator[list[E]]:
        """The table's entries in pieces of at most `size`, for a walk in pieces over the whole table (a Clear):
        each shard's entries are copied (one C call, about 1/SHARDS of the table) when the walk reaches that shard,
        so an entry of a later piece may have left the table meanwhile (the walker checks)."""
        for shard in self._all_shards():
            snap = list(shard.values())
            for j in range(0, len(snap), size):
                yield snap[j:j + size]


class SegmentedSet(Generic[K]):
    """A set in segments of at most KEYSET_SEGMENT keys, which answers as one set: the keys of a namespace's group
    that are READY in L1 (`KeySet`), and what a large request collects per object (a lookup's misses and
    objects of another namespace). Below KEYSET_SEGMENT keys it is one plain set (`view`: asked in C).

    Sets, which the cycle collector tracks (a full collection walks every key), where dicts of keys would not
    be: the full-hit question `set.issuperset(list)` is the latency case's hot path, and no dict question answers
    it as fast."""
    __slots__ = ("segs",)

    def __init__(self) -> None:
        self.segs: list[set[K]] = [set()]

    def __len__(self) -> int:
        return sum(map(len, self.segs))

    def __bool__(self) -> bool:
        return any(self.segs)

    def __contains__(self, key: K) -> bool:
        return any(key in s for s in self.segs)

    def add(self, key: K) -> None:
        segs = self.segs
        last = segs[-1]
        if len(segs) > 1 or len(last) >= KEYSET_SEGMENT:  # only past one segment: a key held in another is left
            if key in self:
                return
            if len(last) >= KEYSET_SEGMENT:
                last = set()
                segs.append(last)
        last.add(key)

    def discard(self, key: K) -> None:
        segs = self.segs
        for i, s in enumerate(segs):
            if key in s:
                s.remove(key)
                if not s and len(segs) > 1:
                    del segs[i]
                return

    def issuperset(self, keys: list[K]) -> bool:
        """Whether every one of `keys` is held: one C call when the set is one segment."""
        segs = self.segs
        if len(segs) == 1:
            return segs[0].issuperset(keys)
        left = set(keys)
        for s in segs:
            left = left.difference(s)  # walks `left`, not `s`
            if not left:
                return True
        return False

    def keys(self) -> set[K]:
        return set().union(*self.segs)

    def view(self) -> set[K] | SegmentedSet[K]:
        """What to ask `in` of, once per object: the one segment itself while there is one (a question in C),
        else this set. Valid until the next `add` or `discard`."""
        return self.segs[0] if len(self.segs) == 1 else self


KeySet = SegmentedSet[bytes]  # the keys of a namespace's group that are READY in L1
ObjectKeys = set[ObjectKey] | SegmentedSet[ObjectKey]
"""Objects a request collects (misses, objects of another namespace): a plain set where the request's size bounds
it (the hit rule asked once, as in tests), a SegmentedSet where it does not (a Lookup's or a Prefetch's)."""
