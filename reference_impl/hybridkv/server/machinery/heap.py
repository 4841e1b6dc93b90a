"""Giving the heap back to the system after large requests.

A 65,536-key PrepareStore of four groups makes the server hold 155 MiB while its 262,144 objects are reserved (an
Entry, its table slot and a Slot each; docs/protocol.md, Limits). Once the reservation ends they are freed, but
glibc keeps most of the pages: freed chunks inside its heap are not returned by themselves, and after a large
block is freed glibc raises its own trim threshold (up to 64 MiB), so even the heap's top stays. `malloc_trim(0)`
returns what is free (tests/server/test_heap.py holds a real server to it). It walks the heap, which costs
milliseconds after a large free and still something when there is nothing to give back, so the loop calls it only
after a large request frame or release, at its next tick, once no request is parked: never on the path of a
lookup.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

LARGE_FRAME = 1 << 20       # a request frame this large decodes into tens of MiB of objects
LARGE_RELEASE = 1 << 14     # objects of leases and reservations closed since the last trim (about 6 MiB)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; another libc (musl) has none: nothing to do
    except (OSError, AttributeError):
        return None


class HeapTrim:
    """Owed once a large request arrived or many objects were let go; paid at the next quiet tick."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self.owed = False
        self._released_at_trim = 0

    def tick(self, released_objects: int, quiet: bool) -> None:
        """`released_objects`: the sessions' running count of objects of closed leases and reservations."""
        if released_objects - self._released_at_trim >= LARGE_RELEASE:
            self.owed = True
        if not (self.owed and quiet and self._trim is not None):
            return
        self._trim(0)
        self.owed = False
        self._released_at_trim = released_objects
