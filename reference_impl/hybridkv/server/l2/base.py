"""What every L2 adapter is: the `L2Adapter` interface the server's worker threads call, its errors, and the
checks of the keys, namespaces and buffers handed to it.

An object is one (chunk key, group) pair: 16 key bytes and a group index, plus the 16-byte namespace of
the engine family it belongs to. The key already hashes the namespace in, so it takes no part in identity;
it is kept for clear-by-namespace and so that an object is served only to its own namespace: `length` and
`get_into` given the asker's `ns` answer an object of another namespace as a miss, and `put` refuses to
replace one (docs/trust-model.md: a client may send another namespace's keys as its own). Payloads are
opaque bytes.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

from hybridkv.model.layout import MAX_GROUPS
from hybridkv.server.l2.header import KEY_BYTES, NS_BYTES


class L2Error(Exception):
    """The L2 tier cannot do what was asked: no room, a disk error, an unusable directory, closed."""


def check_key(key: bytes, group: int) -> None:
    """Reject a key that is not 16 bytes or a group no layout has (a layout has at most MAX_GROUPS), naming the
    value. The header stores a u32, but an object of a group past MAX_GROUPS is nobody's, and each group is a
    table of its own in an index (`table.ObjectTable`)."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        shown = len(key) if isinstance(key, bytes | bytearray | memoryview) else type(key).__name__
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {shown!r} ({key!r:.60})")
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < MAX_GROUPS:
        raise ValueError(f"group must be an int in [0, {MAX_GROUPS - 1}], got {group!r}")


def check_ns(ns: bytes) -> None:
    """Reject a namespace that is not 16 bytes, naming the value."""
    if not isinstance(ns, bytes) or len(ns) != NS_BYTES:
        raise ValueError(f"namespace must be {NS_BYTES} bytes, got {ns!r:.60}")


def byte_view(buf: memoryview | bytes | bytearray, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer, without copying it."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError(f"buffer must be C-contiguous, got shape {mv.shape} strides {mv.strides}")
    if writable and mv.readonly:
        raise ValueError("output buffer is read-only")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


class L2Adapter(abc.ABC):
    """A capacity-bounded, LRU-evicting object store below L1. Every method is thread-safe."""

    @abc.abstractmethod
    def put(self, key: bytes, group: int, ns: bytes, data: memoryview | bytes) -> None:
        """Store an object; once this returns, a SIGKILL of this process does not lose it.

        Idempotent: a second put of an object already held is a no-op. Evicts least-recently-used
        objects to make room. Raises `L2Error` with the reason when it cannot store the object, and when
        the store holds (key, group) under another namespace than `ns` (never replaced by another's bytes).
        """

    @abc.abstractmethod
    def get_into(self, key: bytes, group: int, out: memoryview, ns: bytes | None = None) -> bool:
        """Read an object into `out` (writable, exactly the object's length) and verify its checksum.

        True on success. A missing or damaged object is a miss (False): a damaged one is removed and
        never served. With `ns`, an object of another namespace is a miss too (and kept: it is not
        damaged). `out`'s contents are unspecified after False. A wrong-sized `out` is a
        `ValueError` (the caller's bug, not the store's).
        """

    def contains(self, key: bytes, group: int) -> bool:
        """Whether the object is held (what `length` answers)."""
        return self.length(key, group) is not None

    @abc.abstractmethod
    def length(self, key: bytes, group: int, ns: bytes | None = None) -> int | None:
        """The object's payload length, or None when it is not held (from the index; no I/O); with `ns`, None
        also when it is held under another namespace."""

    @abc.abstractmethod
    def remove(self, key: bytes, group: int) -> bool:
        """Drop an object; True if it was held."""

    def clear(self, ns: bytes | None = None) -> int:
        """Drop every object of namespace `ns` (every object when None); returns how many."""
        return sum(self.clear_steps(ns))

    def clear_steps(self, ns: bytes | None = None) -> Iterator[int]:
        """`clear` in bounded pieces, each yielding how many objects it dropped, so that the server's loop serves
        other requests between two (a Clear in turns). No lock is held across a yield; an object stored after
        the piece that would have dropped it may stay."""
        if ns is not None:
            check_ns(ns)
        for counts in self.clear_walk(None if ns is None else frozenset((ns,))):
            yield sum(counts.values())

    @abc.abstractmethod
    def clear_walk(self, namespaces: frozenset[bytes] | None) -> Iterator[dict[bytes, int]]:
        """`clear_steps` for several namespaces in one walk (every namespace when None): each piece yields how many
        objects of each namespace it dropped. The server's Clears that wait together share one walk this way."""

    @abc.abstractmethod
    def touch(self, key: bytes, group: int) -> None:
        """Mark an object as just used, so LRU eviction takes it last. No-op when not held."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters and gauges: objects, bytes, capacity_bytes, puts, gets, hits, misses,
        corrupt_removed, evictions, bytes_written, bytes_read (adapters may add more)."""

    def probe(self, oids: list[tuple[bytes, int]]) -> None:
        """Warm the index for these objects in one round trip, so the `length` calls after it do no I/O.

        A no-op for adapters whose index is local; the server calls it before a lookup or a store walks
        its objects one by one.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's resources; later calls other than stats() raise `L2Error`. Idempotent."""

    def __enter__(self) -> L2Adapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
