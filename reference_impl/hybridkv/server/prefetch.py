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

from hybridkv import protocol as P
from hybridkv.policy import resume_objects
from hybridkv.server.context import Answer, Context, Frames, RequestError
from hybridkv.server.l1 import Entry, NoSlot, ObjectKey, State
from hybridkv.server.lookup import count_foreign, hit_length, resume_request
from hybridkv.server.objects import Held
from hybridkv.server.sessions import Engine

E = P.ErrorCode


def prefetch(ctx: Context, ident: bytes, msg: P.Prefetch, frames: Frames) -> Answer:
    eng, keys = resume_request(ctx, ident, msg, frames)
    if eng.prefetches >= ctx.config.max_prefetches:
        raise RequestError(E.LIMIT, f"engine {eng.id} has {eng.prefetches} prefetches still reading, the "
                           f"limit (--max-prefetches {ctx.config.max_prefetches})")
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


class PrefetchOp:
    """The reads of one prefetch. It holds (pins) the prefix's objects only while its own reads run, so
    that a later read of it never evicts an earlier one (clean objects are evicted first, and a finished
    read is clean); when the last read ends it lets them go as the most recently used. It never answers
    again: the reply went out with the first step, so step() reports nothing and raises nothing."""

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
        objects, counters = self.ctx.objects, self.ctx.counters
        while self.todo:
            oid, length = self.todo[-1]
            if objects.get(oid) is not None or objects.held(oid, self.eng.ns, length) is not Held.MINE:  # in L2?
                self.todo.pop()  # brought in by a lookup meanwhile, or gone from L2: nothing to read
                continue
            r = objects.prefetch(oid, self.eng.ns, length)
            if r is NoSlot.WAIT:
                return
            if r is NoSlot.FULL:
                self.refused += len(self.todo)
                counters.prefetch_objects_refused += len(self.todo)
                self.todo.clear()
                return
            objects.pin(r)
            self.held.append(r)
            self.todo.pop()
            self.started += 1
            counters.prefetch_objects_started += 1

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
