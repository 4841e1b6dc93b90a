"""Clear in turns: a namespace's (or, for an admin, every namespace's) unpinned objects dropped from L1 a bounded
piece at a time on the loop (`ObjectStore.clear_l1_steps`), then from L2 on an I/O thread in the adapter's pieces
(`L2Adapter.clear_steps`: its lock held per piece, never for the whole walk), so that a Clear of a million objects,
which any client may send for its own namespace, does not hold the loop (in one step it held it for seconds, and
a filesystem L2's files unlinked on the loop for minutes): every other client's
requests are answered meanwhile. A Clear that finishes in its first turn (a small L1, a local L2 index of a few
dozen objects or none) answers at once, as before. L2 walks run one at a time, and the Clears that wait for one
share it, whatever their namespaces (`clear_lane`): a flood of Clears holds one I/O thread, not all of them, and no
Clear waits more than two walks.

What it drops: the objects of the namespace that are present and evictable (READY, unpinned, not being spilled)
when their piece is reached; pinned ones, and ones stored or unpinned after their piece passed, stay. Clears that
shared an L2 walk each count what it dropped of their own namespace. An engine unregistered or reclaimed while its
Clear works is answered unknown_engine (as a Lookup in turns is); what was dropped by then stays dropped, and an L2
walk under way stops at its next piece once every Clear sharing it has stopped (until then it may drop more of that
namespace, which a cache may always do). The admin form (engine None) has no engine to lose.
"""

from __future__ import annotations

from typing import Any

from hybridkv.server.books.records import Engine
from hybridkv.server.ops.context import Answer, Context
from hybridkv.server.ops.turns import TURN, WAIT, Clock, Work, drive
from hybridkv.wire import protocol as P

# A local L2 index of at most this many objects is cleared in the Clear's own turn. Its clear removes a file per
# object of the namespace (tens of microseconds each, more on a loaded disk): a turn's share is a few dozen, and an
# index of 4,096 (turns.BIG_OBJECTS, the bound before) held the loop for as long as its files took to remove.
L2_HERE_OBJECTS = 64


class TurnedClearOp:
    """A Clear working in turns; answers Done{count} once its last piece is done."""

    def __init__(self, ctx: Context, ident: bytes, req_id: int, eng: Engine | None, ns: bytes | None):
        self.ctx, self.ident, self.req_id, self.eng, self.ns = ctx, ident, req_id, eng, ns
        self.clock = Clock()
        self.count = 0
        self.answered = False
        self.stopped = False  # read by the L2 walk's thread between its pieces (`clear_lane`)
        self._l2: tuple[Any, BaseException | None] | None = None
        self._work = self._run()

    def _run(self) -> Work:
        objects = self.ctx.objects
        for n in objects.clear_l1_steps(self.ns):
            self.count += n
            if self.clock.over():
                yield TURN
        l2 = objects.l2
        if l2 is None:
            return
        if not objects.probes_l2 and l2.stats()["objects"] <= L2_HERE_OBJECTS:  # a tiny local index: here and now
            self.count += l2.clear(self.ns)
            return
        self.ctx.clear_lane.join(self, self.ctx.workers, objects, self.ctx.counters)  # one walk at a time, shared
        while self._l2 is None:
            yield WAIT
        n, exc = self._l2
        if exc is not None:
            raise exc
        self.count += n

    def l2_done(self, n: int, exc: BaseException | None) -> None:
        self._l2 = (n, exc)

    def turn(self) -> bool:
        """One turn of work; True once every piece is done."""
        return drive(self.ctx, self._work, self.clock)

    def step(self) -> bool:
        ctx, eng = self.ctx, self.eng
        if eng is not None and ctx.sessions.engines.get(eng.id) is not eng:
            self._stop()
            ctx.fail(self.ident, self.req_id, P.ErrorCode.UNKNOWN_ENGINE, f"engine {eng.id} was unregistered or "
                     f"reclaimed while its clear worked ({self.count} objects dropped by then)")
            return True
        try:
            if not self.turn():
                return False
        except BaseException:
            self._stop()
            raise  # the loop answers it
        self.answered = True
        ctx.send(self.ident, self.req_id, P.Done(count=self.count), ())
        return True

    def _stop(self) -> None:
        self.stopped = self.answered = True
        self._work.close()


def clear(ctx: Context, ident: bytes, req_id: int, eng: Engine | None, ns: bytes | None) -> Answer:
    """Clear `ns` (every namespace when None): answered now when one turn does it all, else in turns."""
    op = TurnedClearOp(ctx, ident, req_id, eng, ns)
    try:
        if op.turn():
            return P.Done(count=op.count), []
    except BaseException:
        op.stopped = True
        raise
    ctx.park(op)
    return None
