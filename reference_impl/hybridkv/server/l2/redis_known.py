"""What one server knows of a shared Redis / Valkey store's objects: each one's length, or that it is missing.

The server loop asks the L2 `length` for every object of a lookup, and a round trip each would hold it; so lengths
are kept here, trusted for `ttl_s` (a known miss for `miss_ttl_s`: another host may store the object meanwhile), the
oldest forgotten past `max_known`, and all of them forgotten when the store may have restarted empty. An object of
another namespace is known with its namespace, so that it is answered as a miss to the others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from hybridkv.model.keys import ObjectKey
from hybridkv.server.machinery.lru import Indexed, LruIndex


class Known(Indexed):  # oid, size: the length or 0 (the index's `bytes`: the bytes known to be held)
    length: int | None  # None: known to be missing
    ns: bytes
    until: float        # monotonic time after which the store is asked again


class KnownLengths:
    """The lengths known of the store's objects, oldest first, with how many are known held and their bytes."""

    def __init__(self, ttl_s: float, miss_ttl_s: float, max_known: int) -> None:
        self._ttl_s, self._miss_ttl_s, self._max_known = ttl_s, miss_ttl_s, max_known
        self._lock = threading.Lock()
        self._index: LruIndex[Known] = LruIndex()  # oldest first; in pieces, as one dict stalled the loop
        self._held = 0  # the known objects with a length (not known to be missing)

    def fresh(self, okey: ObjectKey, ns: bytes | None = None) -> tuple[bool, int | None]:
        """(whether the object is freshly known, its length: None when known missing or of another namespace
        than `ns`)."""
        with self._lock:
            k = self._index.get(okey)
            if k is None or time.monotonic() >= k.until:
                return False, None
            return True, k.length if ns is None or k.ns == ns else None

    def fresh_length(self, okey: ObjectKey, ns: bytes | None = None) -> int | None:
        """The length freshly known (of namespace `ns`, when given), else None (`fresh`'s answer without its flag)."""
        return self.fresh(okey, ns)[1]

    def length(self, okey: ObjectKey, ns: bytes | None = None) -> int | None:
        """The length known, fresh or not (None when unknown, missing, or of another namespace than `ns`)."""
        with self._lock:
            k = self._index.get(okey)
            return None if k is None or (ns is not None and k.ns != ns) else k.length

    def stale(self, oids: Iterable[ObjectKey]) -> list[ObjectKey]:
        """Those of `oids` not freshly known, each once, in order."""
        now = time.monotonic()
        with self._lock:
            return [o for o in dict.fromkeys(oids) if (kn := self._index.get(o)) is None or now >= kn.until]

    def remember(self, okey: ObjectKey, length: int | None, ns: bytes) -> None:
        """Know the object's length (None: missing) for the time its kind is trusted; forget the oldest past the
        bound."""
        ttl = self._ttl_s if length is not None else self._miss_ttl_s
        k = Known(okey, length or 0, length, ns, time.monotonic() + ttl)
        with self._lock:
            gone = [self._index.put(k)]
            while len(self._index) > self._max_known:
                gone.append(self._index.pop_oldest())
            self._held += (length is not None) - sum(g is not None and g.length is not None for g in gone)

    def forget(self, okey: ObjectKey) -> None:
        with self._lock:
            k = self._index.pop(okey)
            self._held -= k is not None and k.length is not None

    def forget_all(self) -> None:
        with self._lock:
            old, self._index, self._held = self._index, LruIndex(), 0
        old.clear()  # segment by segment, not under the lock that length() waits on

    def totals(self) -> tuple[int, int]:
        """(objects known held, their bytes), without walking the index."""
        with self._lock:
            return self._held, self._index.bytes

    def values(self) -> Iterator[Known]:
        """The entries, oldest first (for tests and tools: not under the lock)."""
        return iter(self._index.values())

    def __contains__(self, okey: ObjectKey) -> bool:
        return okey in self._index

    def __len__(self) -> int:
        return len(self._index)
