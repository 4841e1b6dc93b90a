"""Prefetch: bring a prefix the engine will ask for soon from L2 into L1, answered at once, leaving no pin.

An engine sends it when it knows a request is coming (a conversation's next message arrived, its user
started typing) so that the L2 reads overlap the time until the lookup instead of adding to its TTFT.
The prefix is the Lookup hit rule's (hitrule.py), in the engine's namespace only (another
namespace's objects under its keys are misses, and never read). Each of its
objects not in L1 gets an L2 read into a fresh slot, exactly as a lookup's would: an object already
LOADING is not read twice, and reads take only evictable room (unpinned READY objects, clean ones
first, dirty ones after their spill), never pinned, reserved or loading ones. When spills must free
room first the reply counts the objects as waiting and the server starts them as the spills finish;
when nothing is evictable the rest is refused. Once its reads have ended the prefix's objects are the
most recently used of L1 and pinned by nobody: the lookup that follows pins them as usual.
"""

from __future__ import annotations

from hybridkv.model.policy import resume_slices
from hybridkv.server.books.l1 import Entry, NoSlot, ObjectKey, State
from hybridkv.server.books.objects import Held, all_ready
from hybridkv.server.books.records import Engine
from hybridkv.server.machinery.table import SegmentedSet
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError
from hybridkv.server.ops.hitrule import count_foreign, hit_length_turns
from hybridkv.server.ops.lookup import op_clock, resume_request
from hybridkv.server.ops.turns import SLICE_OBJECTS, TURN, WAIT, Clock, TurnedOp, Work, probe_l2, unpin
from hybridkv.wire import protocol as P

E = P.ErrorCode


def prefetch(ctx: Context, ident: bytes, msg: P.Prefetch, frames: Frames) -> Answer:
    eng, keys = resume_request(ctx, ident, msg, frames)
    if eng.prefetches >= ctx.config.max_prefetches:
        raise RequestError(E.LIMIT, f"engine {eng.id} has {eng.prefetches} prefetches still reading, the "
                           f"limit (--max-prefetches {ctx.config.max_prefetches})")
    op = PrefetchOp(ctx, ident, msg, eng, keys, op_clock(eng, keys))
    eng.prefetches += 1  # from now on: a second prefetch of this engine counts it
    if not op.step():
        ctx.park(op)
    return None


class PrefetchOp(TurnedOp):
    """The hit rule, the objects L1 lacks, the pins of those it holds and the reads it starts, then the reply, then
    the reads' wait and the unpinning: a generator (`_run`), in turns of TURN_S when large (turns.py). It holds
    (pins) the prefix's objects only while its own reads run, so that a later read of it never evicts an earlier
    one (clean objects are evicted first, and a finished read is clean); when the last read ends it lets them go as
    the most recently used. Between two turns (or while it waits) an object may come or go: one READY under another
    namespace by the time it is pinned is neither pinned nor counted, and `_start` skips what a lookup brought in or
    L2 dropped meanwhile."""

    kind = "prefetch"

    def __init__(self, ctx: Context, ident: bytes, msg: P.Prefetch, eng: Engine, keys: list[bytes],
                 clock: Clock):
        self.ctx, self.ident, self.req_id, self.msg, self.eng, self.keys = ctx, ident, msg.id, msg, eng, keys
        self.todo: list[tuple[ObjectKey, int]] = []  # objects left to read, popped from the end (prefix order)
        self.held: list[Entry] = []
        self.reads: list[Entry] = []  # the reads it started, in order
        self.started = self.loading = self.refused = 0
        self.answered = False
        self.counted = True  # in eng.prefetches until it lets go of its pins
        self.clock = clock
        self._work: Work = self._run()

    def _drop_all(self) -> None:
        self.ctx.objects.unpin_all(self.held)
        self.held = []
        self._uncount()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.eng.prefetches -= 1

    def _run(self) -> Work:
        ctx, eng, keys, msg, clock = self.ctx, self.eng, self.keys, self.msg, self.clock
        objects, lengths, ns = ctx.objects, eng.object_bytes, eng.ns
        get = objects.get
        yield from probe_l2(objects, keys, len(eng.layout.groups), clock)
        foreign: SegmentedSet[ObjectKey] = SegmentedSet()
        n = yield from hit_length_turns(ctx, eng, keys, msg.policy, set(), foreign, clock)
        count_foreign(ctx, foreign)
        absent = 0
        # no list of the prefix's objects is kept: freeing half a million pairs at once would take a turn of its own
        for pairs in resume_slices(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens, SLICE_OBJECTS):
            absent += sum(lengths[g] for c, g in pairs if get((keys[c], g)) is None)
            if clock.over():
                yield TURN
        capacity = objects.l1.alloc.size
        if absent > capacity:
            self._uncount()
            self.answered = True
            ctx.counters.limit_refusals += 1
            ctx.fail(self.ident, self.req_id, E.LIMIT, f"prefetch of {n} chunks needs {absent} B of L1 for objects "
                     f"not in it; L1 holds {capacity} B")
            return
        ctx.counters.prefetch_requests += 1
        in_l1 = 0
        left: list[tuple[ObjectKey, int]] = []
        ready, loading = State.READY, State.LOADING
        for pairs in resume_slices(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens, SLICE_OBJECTS):
            part = [((keys[c], g), lengths[g]) for c, g in pairs]
            es = objects.l1.get_many([oid for oid, _ in part])
            if all_ready(es, ns):
                objects.pin_all(es)
                self.held += es
                in_l1 += len(es)
            else:
                for (oid, length), e in zip(part, es, strict=True):
                    if e is None:
                        left.append((oid, length))
                    elif e.ns != ns or e.length != length:
                        continue  # replaced under another namespace since the hit rule saw it: not this prefix's
                    elif e.state is ready:
                        objects.pin(e)
                        self.held.append(e)
                        in_l1 += 1
                    elif e.state is loading:
                        self.loading += 1  # a lookup's read: that lookup holds it
            if clock.over():
                yield TURN
        ctx.counters.prefetch_objects_in_l1 += in_l1
        self.todo = left[::-1]
        yield from self._start()
        self.answered = True
        ctx.send(self.ident, self.req_id, P.Prefetching(hit_chunks=n, in_l1=in_l1, loading=self.loading,
                                                        started=self.started, waiting=len(self.todo),
                                                        refused=self.refused), ())
        yield from self._let_go()

    def _start_next(self) -> bool:
        """Start the read of the last object of `todo`, or pass it by (a lookup brought it in meanwhile, or L2
        dropped it: nothing to read). False when no read can start now: L1 must make room first (todo kept),
        or nothing is evictable (the rest refused)."""
        objects, counters, ns = self.ctx.objects, self.ctx.counters, self.eng.ns
        oid, length = self.todo[-1]
        if objects.get(oid) is not None or objects.held(oid, ns, length) is not Held.MINE:  # in L2?
            self.todo.pop()
            return True
        r = objects.prefetch(oid, ns, length)
        if r is NoSlot.WAIT:
            return False
        if r is NoSlot.FULL:
            self.refused += len(self.todo)
            counters.prefetch_objects_refused += len(self.todo)
            self.todo.clear()
            return False
        assert isinstance(r, Entry)
        objects.pin(r)
        self.held.append(r)
        self.todo.pop()
        self.started += 1
        counters.prefetch_objects_started += 1
        self.reads.append(r)
        return True

    def _start(self) -> Work:
        """Start reads until every object is started or room must first be made, with a turn between pieces."""
        tried = 0
        while self.todo:
            tried += 1
            if tried % 64 == 0 and self.clock.over():
                yield TURN
            if not self._start_next():
                return

    def _let_go(self) -> Work:
        """Start what room allows until nothing is left to start and every read has ended (nothing more once its
        engine is gone), then let the prefix go as the most recently used, in prefix order."""
        ctx, eng, reads = self.ctx, self.eng, self.reads
        while True:
            if ctx.sessions.engines.get(eng.id) is eng:
                yield from self._start()
            else:
                self.todo.clear()
            while reads and (reads[-1].state is not State.LOADING or reads[-1].gone):
                reads.pop()
            if not self.todo and not reads:
                break
            yield WAIT
        held, self.held = self.held, []
        yield from unpin(ctx.objects, held, self.clock)
        self._uncount()
