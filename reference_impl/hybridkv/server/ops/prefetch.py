"""Prefetch: bring a prefix the engine will ask for soon from L2 into L1, answered at once, leaving no pin.

An engine sends it when it knows a request is coming (a conversation's next message arrived, its user
started typing) so that the L2 reads overlap the time until the lookup instead of adding to its TTFT.
The prefix is the Lookup hit rule's (`lookup.hit_length`), in the engine's namespace only (another
namespace's objects under its keys are misses, and never read). Each of its
objects not in L1 gets an L2 read into a fresh slot, exactly as a lookup's would: an object already
LOADING is not read twice, and reads take only evictable room (unpinned READY objects, clean ones
first, dirty ones after their spill), never pinned, reserved or loading ones. When spills must free
room first the reply counts the objects as waiting and the server starts them as the spills finish;
when nothing is evictable the rest is refused. Once its reads have ended the prefix's objects are the
most recently used of L1 and pinned by nobody: the lookup that follows pins them as usual.
"""

from __future__ import annotations

from operator import attrgetter
from typing import cast

from hybridkv import protocol as P
from hybridkv.policy import resume_objects, resume_slices
from hybridkv.server.books.l1 import Entry, NoSlot, ObjectKey, State
from hybridkv.server.books.objects import Held
from hybridkv.server.books.records import Engine
from hybridkv.server.machinery.table import SegmentedSet
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError
from hybridkv.server.ops.hitrule import count_foreign, hit_length, hit_length_turns
from hybridkv.server.ops.lookup import resume_request
from hybridkv.server.ops.turns import BIG_OBJECTS, SLICE_OBJECTS, TURN, WAIT, Clock, TurnedOp, Work, probe_l2, unpin

E = P.ErrorCode
_state, _ns = attrgetter("state"), attrgetter("ns")


def prefetch(ctx: Context, ident: bytes, msg: P.Prefetch, frames: Frames) -> Answer:
    eng, keys = resume_request(ctx, ident, msg, frames)
    if eng.prefetches >= ctx.config.max_prefetches:
        raise RequestError(E.LIMIT, f"engine {eng.id} has {eng.prefetches} prefetches still reading, the "
                           f"limit (--max-prefetches {ctx.config.max_prefetches})")
    if len(keys) * len(eng.layout.groups) > BIG_OBJECTS:  # in turns: other clients are answered meanwhile
        big = TurnedPrefetchOp(ctx, ident, msg, eng, keys)
        eng.prefetches += 1  # from now on: a second prefetch of this engine counts it, as in one turn
        if not big.step():
            ctx.park(big)
        return None
    ctx.objects.probe_l2(keys, len(eng.layout.groups))
    foreign: set[ObjectKey] = set()
    n = hit_length(ctx, eng, keys, msg.policy, set(), foreign)
    count_foreign(ctx, foreign)
    objects = resume_objects(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens)
    todo = [((keys[c], g), eng.object_bytes[g]) for c, g in objects]
    capacity = ctx.objects.l1.alloc.size
    absent = sum(length for oid, length in todo if ctx.objects.get(oid) is None)
    if absent > capacity:
        # It could never hold the whole prefix: its reads would fill L1 with its own objects, then be refused.
        raise RequestError(E.LIMIT, f"prefetch of {n} chunks needs {absent} B of L1 for objects not in it; "
                           f"L1 holds {capacity} B")
    ctx.counters.prefetch_requests += 1
    op = PrefetchOp(ctx, ident, msg.id, eng, todo)
    reply = op.first_step(n)
    eng.prefetches += 1
    if not op.step():
        ctx.park(op)
    return reply, []


class _Reads:
    """Starting a prefetch's L2 reads, one object at a time, from the end of `todo` (prefix order)."""

    ctx: Context
    eng: Engine
    todo: list[tuple[ObjectKey, int]]
    held: list[Entry]
    started: int
    refused: int

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
        self._started(r)
        return True

    def _started(self, e: Entry) -> None:
        """A read began (TurnedPrefetchOp keeps them, to wait for each)."""


class PrefetchOp(_Reads):
    """The reads of one prefetch. It holds (pins) the prefix's objects only while its own reads run, so
    that a later read of it never evicts an earlier one (clean objects are evicted first, and a finished
    read is clean); when the last read ends it lets them go as the most recently used. It never answers
    again: the reply went out with the first step, so step() reports nothing and raises nothing."""

    answered = True  # parked only after its reply went out

    def __init__(self, ctx: Context, ident: bytes, req_id: int, eng: Engine, todo: list[tuple[ObjectKey, int]]):
        self.ctx, self.ident, self.req_id, self.eng = ctx, ident, req_id, eng
        self.todo = todo  # objects left to read, popped from the end (prefix order)
        self.held: list[Entry] = []
        self.started = self.loading = self.refused = 0

    def first_step(self, hit_chunks: int) -> P.Prefetching:
        in_l1 = 0
        objects = self.ctx.objects
        left = []
        for oid, length in self.todo:
            e = objects.get(oid)
            if e is None:
                left.append((oid, length))
            elif e.state is State.READY:
                objects.pin(e)
                self.held.append(e)
                in_l1 += 1
            elif e.state is State.LOADING:
                self.loading += 1  # a lookup's read: that lookup holds it
        self.ctx.counters.prefetch_objects_in_l1 += in_l1
        self.todo = left[::-1]
        self._start()
        return P.Prefetching(hit_chunks=hit_chunks, in_l1=in_l1, loading=self.loading, started=self.started,
                             waiting=len(self.todo), refused=self.refused)

    def _start(self) -> None:
        """Start reads until every object is started or room must first be made."""
        while self.todo and self._start_next():
            pass

    def step(self) -> bool:
        """Start what room allows; done once nothing is left to start and every read has ended."""
        if self.ctx.sessions.engines.get(self.eng.id) is self.eng:
            self._start()
        else:
            self.todo.clear()  # its engine was unregistered or reclaimed: nobody will look the prefix up
        if self.todo or any(e.state is State.LOADING and not e.gone for e in self.held):
            return False
        # in prefix order: each object left unpinned goes to its queue's young end, so the prefix's first
        # chunks are the oldest of them
        self.ctx.objects.unpin_all(self.held)
        self.held.clear()
        self.eng.prefetches -= 1
        return True


class TurnedPrefetchOp(TurnedOp, _Reads):
    """A large prefetch (more than BIG_OBJECTS keys x groups) in turns of TURN_S (turns.py): the hit rule, the
    objects L1 lacks, the pins of those it holds and the reads it starts, a piece at a time, then the reply (what
    PrefetchOp answers in one turn), then the reads' wait and the unpinning, in turns too. Between two turns an
    object may come or go: one READY under another namespace by the time it is pinned is neither pinned nor
    counted, and `_start` skips what a lookup brought in or L2 dropped meanwhile, as PrefetchOp's does."""

    def __init__(self, ctx: Context, ident: bytes, msg: P.Prefetch, eng: Engine, keys: list[bytes]):
        self.ctx, self.ident, self.req_id, self.msg, self.eng, self.keys = ctx, ident, msg.id, msg, eng, keys
        self.todo: list[tuple[ObjectKey, int]] = []  # objects left to read, popped from the end (prefix order)
        self.held: list[Entry] = []
        self.reads: list[Entry] = []  # the reads it started, in order
        self.started = self.loading = self.refused = 0
        self.answered = False
        self.counted = True  # in eng.prefetches until it lets go of its pins
        self.clock = Clock()
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
            es = [get(oid) for oid, _ in part]
            if None not in es and list(map(_state, es)).count(ready) == len(es) \
                    and list(map(_ns, es)).count(ns) == len(es):
                full = cast(list[Entry], es)
                objects.pin_all(full)
                self.held += full
                in_l1 += len(full)
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

    def _start(self) -> Work:
        """PrefetchOp._start, with a turn between pieces."""
        tried = 0
        while self.todo:
            tried += 1
            if tried % 64 == 0 and self.clock.over():
                yield TURN
            if not self._start_next():
                return

    def _started(self, e: Entry) -> None:
        self.reads.append(e)

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
