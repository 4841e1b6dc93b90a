"""The L2 parts of Clears, one walk at a time: a Clear's L2 part walks the adapter's whole index on an I/O thread
(`L2Adapter.clear_steps`), so Clears sent together (any client may clear its own namespace, as often as it likes)
would each hold an I/O thread for a walk, and spills and prefetches of every other client would queue behind them.
Here they form one lane: one walk runs at a time, and a Clear of a namespace whose walk is waiting joins that walk
(it starts after the Clear came, so it drops what the Clear must). A flood of Clears then costs one I/O thread and
one walk per namespace named, and delays nothing but Clears.
"""

from __future__ import annotations

from typing import Protocol

from hybridkv.server.objects import ObjectStore
from hybridkv.server.workers import Workers


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

    def join(self, op: ClearsL2, workers: Workers, objects: ObjectStore) -> None:
        """`op`'s L2 part: in the walk waiting for its namespace, or in a new one."""
        ops = self.waiting.get(op.ns)
        if ops is not None:
            ops.append(op)
            return
        self.waiting[op.ns] = [op]
        self._start(workers, objects)

    def _start(self, workers: Workers, objects: ObjectStore) -> None:
        if self.running is not None or not self.waiting:
            return
        ns = next(iter(self.waiting))
        ops = self.running = self.waiting.pop(ns)
        l2 = objects.l2
        assert l2 is not None

        def walk() -> int:  # on an I/O thread: until done, every Clear in it stopped, or the server stops
            n = 0
            for piece in l2.clear_steps(ns):
                n += piece
                if objects.stopping or all(op.stopped for op in ops):
                    break
            return n

        def done(n: int, exc: BaseException | None) -> None:  # on the loop
            self.running = None
            for op in ops:
                op.l2_done(n, exc)
            self._start(workers, objects)

        if not workers.submit(walk, done):
            self.running = None
            gone = RuntimeError("the server is shutting down")
            for waiting in [ops, *self.waiting.values()]:
                for op in waiting:
                    op.l2_done(0, gone)
            self.waiting.clear()
