"""Arena bytes lent out of the loop thread: their slots stay allocated as long as anything else may still read them.

A raw Retrieve answers with frames that are views of the arena (zero-copy), which libzmq sends later on its own
thread; a pickle, torch_save or CUDA-IPC Retrieve reads the arena on a worker thread after its handler returned.
Meanwhile the loop goes on: the client may release its lease (Release, EndSession, Unregister, or its reclaim),
the objects be evicted or cleared, and another tenant's store be written into their slots, whose bytes the reply
would then carry. So whatever reads lent bytes holds a Loan, and a slot is freed only once no loan holds it
(`L1Cache.lend`, `give_back`): an object dropped meanwhile leaves the table at once, its slot held back like a
quarantined one. Every release and eviction path stays as it is, and none of them waits for the reader.

A loan comes back when it is closed (a worker's job, once it has read) or when neither it nor any of its views is
referenced any more: pyzmq references a zero-copy frame's object until libzmq lets go of the frame (sent, dropped
over the send high-water mark, or dropped with its connection), then drops it on its own garbage-collector thread.
Its slots are given back on the loop thread (`take_back`), woken like a worker's completion. A client that never
reads its replies holds at most its send queue of them (--max-queued-replies) until it disconnects.
"""

from __future__ import annotations

import queue
import weakref
from collections.abc import Callable

import numpy as np

from hybridkv.memory.arena import Arena
from hybridkv.server.books.l1 import Entry, L1Cache


class Loan:
    """Lent objects' zero-copy `views`; see the module's docstring for when it ends."""

    __slots__ = ("views", "_back")

    def __init__(self, views: list[memoryview], back: weakref.finalize):
        self.views = views
        self._back = back

    def close(self) -> None:
        """The reader is done: the loan goes back now (idempotent; safe on any thread)."""
        self.views = []
        self._back()


class Loans:
    """The loans of one arena: made and taken back on the loop thread, given back from any thread."""

    # pyzmq copies a frame smaller than this into its message when it is sent (the loop sets its socket's
    # copy_threshold to it): such a frame is no view of the arena once the send returns, so it needs no loan.
    copy_threshold = 1 << 16

    def __init__(self, arena: Arena, l1: L1Cache, wake: Callable[[], None]):
        self.arena = arena
        self._l1 = l1
        self._wake = wake
        self._back: queue.SimpleQueue[list[Entry]] = queue.SimpleQueue()
        self._closed = False
        self.open = 0      # loans not taken back yet
        self.objects = 0   # their objects

    def lend(self, entries: list[Entry]) -> Loan:
        """Lend `entries` and view their bytes. The views are slices of a memoryview of one array made for this
        loan: each holds it, so it is freed (and the loan given back) only once the last of them is."""
        entries = list(entries)  # its own list: whatever empties the lease's later, these are the ones lent
        base = np.frombuffer(self.arena.buf, np.uint8)
        self._l1.lend(entries)
        self.open += 1
        self.objects += len(entries)
        back = weakref.finalize(base, self._given_back, entries)
        back.atexit = False  # at interpreter exit the arena and the loop are gone: nothing to give back
        view = base.data  # a memoryview of `base`: its slices are cheaper than the array's, and hold `base` alike
        return Loan([view[e.offset:e.offset + e.length] for e in entries], back)

    def _given_back(self, entries: list[Entry]) -> None:
        # any thread (pyzmq's garbage collector, a worker, the loop): only queue it and wake the loop
        self._back.put(entries)
        if not self._closed:
            self._wake()

    def take_back(self) -> int:
        """On the loop thread: free what the loans given back since the last call held; how many loans. One step
        per loan, at a tenth of a microsecond an object: a reply's frames took far longer to send."""
        n = 0
        while True:
            try:
                entries = self._back.get_nowait()
            except queue.Empty:
                return n
            self._l1.give_back(entries)
            self.open -= 1
            self.objects -= len(entries)
            n += 1

    def close(self) -> None:
        """The loop stops: loans given back from now on wake nobody."""
        self._closed = True
