"""The L2 parts of Clears, one walk at a time: a Clear's L2 part walks the adapter's whole index on an I/O thread
(`L2Adapter.clear_walk`), so Clears sent together (any client may clear its own namespace, as often as it likes)
would each hold an I/O thread for a walk, and spills and prefetches of every other client would queue behind them.
Here they form one lane: one walk runs at a time, and every Clear that came while it ran waits for the next, which
drops the objects of all their namespaces at once (it starts after they came, so it drops what each must). A flood
of Clears then costs one I/O thread, and any Clear waits for two walks at most, however many namespaces the flood
names (before, one walk per namespace: a client with 64 engines could hold another's Clear for 64 walks).
"""

from __future__ import annotations

from typing import Protocol

from hybridkv.server.books.counters import Counters
from hybridkv.server.books.objects import ObjectStore
from hybridkv.server.machinery.workers import Workers


class ClearsL2(Protocol):
    """A Clear waiting for its L2 part: its namespace (None: every one), whether it stopped (read between the walk's
    pieces), and where the walk's count or error goes (on the loop thread)."""
    ns: bytes | None
    stopped: bool

    def l2_done(self, n: int, exc: BaseException | None) -> None: ...


class ClearLane:
    """The Clears waiting for an L2 walk, per namespace, and the ones whose walk runs."""
    __slots__ = ("waiting", "running")

    def __init__(self) -> None:
        self.waiting: dict[bytes | None, list[ClearsL2]] = {}
        self.running: list[ClearsL2] | None = None

    def join(self, op: ClearsL2, workers: Workers, objects: ObjectStore, counters: Counters) -> None:
        """`op`'s L2 part: in the next walk, which starts now when none runs."""
        self.waiting.setdefault(op.ns, []).append(op)
        self._start(workers, objects, counters)

    def _start(self, workers: Workers, objects: ObjectStore, counters: Counters) -> None:
        if self.running is not None or not self.waiting:
            return
        batch, self.waiting = self.waiting, {}
        ops = self.running = [op for waiting in batch.values() for op in waiting]
        namespaces = None if None in batch else frozenset(ns for ns in batch if ns is not None)
        l2 = objects.l2
        assert l2 is not None

        def walk() -> dict[bytes, int]:  # on an I/O thread: until done, every Clear in it stopped, or the server stops
            counts: dict[bytes, int] = {}
            for piece in l2.clear_walk(namespaces):
                for ns, n in piece.items():
                    counts[ns] = counts.get(ns, 0) + n
                if objects.stopping or all(op.stopped for op in ops):
                    break
            return counts

        def done(counts: dict[bytes, int] | None, exc: BaseException | None) -> None:  # on the loop
            self.running = None
            counts = counts or {}
            total = sum(counts.values())
            for op in ops:
                op.l2_done(total if op.ns is None else counts.get(op.ns, 0), exc)
            self._start(workers, objects, counters)

        if workers.submit(walk, done):
            counters.l2_clear_walks += 1
        else:
            self.running = None
            gone = RuntimeError("the server is shutting down")
            for waiting in [ops, *self.waiting.values()]:
                for op in waiting:
                    op.l2_done(0, gone)
            self.waiting.clear()
