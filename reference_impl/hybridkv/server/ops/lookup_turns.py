"""A large Lookup (more than BIG_OBJECTS keys x groups) in turns of TURN_S (turns.py), so that every other
client's request is answered between its turns; it answers what the one-turn lookup answers.

What another request may change between two turns, and what the lookup does about it:
- an object it has pinned stays as it is (a pinned READY object is never evicted, dropped or written over), so
  every object is pinned as it is counted; a LOADING one whose L2 read fails is gone, and the lookup starts over;
- an object the hit rule found in an earlier turn may be gone, held under another namespace, or being re-stored
  when the lookup comes to pin it: it is a miss, and the hit rule is asked again without it (as the one-turn lookup
  does when L1 has no room for a read);
- its engine unregistered or reclaimed: answered `unknown_engine`, its pins let go (in turns);
- an EndSession of its request sent after it: this lookup answers first and its lease is released at once,
  counted in that EndSession's answer, which follows (retrieve.end_session): the order of one turn;
- the server shutting down: answered `shutting_down` like every parked request.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, cast

from hybridkv import protocol as P
from hybridkv.policy import resume_bytes, resume_slices
from hybridkv.server.books.l1 import Entry, NoSlot, ObjectKey, State
from hybridkv.server.books.records import Engine
from hybridkv.server.machinery.table import SegmentedSet
from hybridkv.server.ops.context import Context
from hybridkv.server.ops.hitrule import count_foreign, count_hit, hit_length_turns
from hybridkv.server.ops.turns import (
    SLICE_OBJECTS,
    TURN,
    WAIT,
    Clock,
    Steps,
    TurnedOp,
    Work,
    encoded_locs,
    probe_l2,
    unpin,
)

_state, _ns, _offset, _length = (attrgetter(a) for a in ("state", "ns", "offset", "length"))
Pinned = tuple[list[Entry], list[P.ObjectLoc], bool]  # the answer's entries and places, and whether it is complete


class TurnedLookupOp(TurnedOp):
    """A large lookup, pinned or not; a generator (`_run`) that yields TURN or WAIT (turns.py)."""

    ends_with_session = True  # an EndSession of its request waits for it (retrieve.end_session)

    def __init__(self, ctx: Context, ident: bytes, msg: P.Lookup, eng: Engine, keys: list[bytes]):
        self.ctx, self.ident, self.req_id, self.msg, self.eng, self.keys = ctx, ident, msg.id, msg, eng, keys
        # Its pins, as lists (a dict of half a million objects would stop the loop for tens of ms as it grows):
        # `pins` those of the pass under way, one per object of its answer in order; `stale` those of the passes
        # before it (a pass pins afresh what an earlier pass had pinned too), let go once a pass has finished.
        self.pins: list[Entry] = []
        self.stale: list[Entry] = []
        # What it collects per object over all its passes, in segments (table.SegmentedSet): its size bounds neither
        self.missing: SegmentedSet[ObjectKey] = SegmentedSet()
        self.foreign: SegmentedSet[ObjectKey] = SegmentedSet()  # objects of another namespace (counted once)
        self.loading: list[Entry] = []
        self.waited = False
        self.from_l2: set[int] = set()
        self.answered = False
        self.ended_by: list[Any] = []  # EndSession answers waiting for this one (retrieve.EndSessionWait)
        self.clock = Clock()
        self._work: Work = self._run()

    def _drop_all(self) -> None:
        self.ctx.objects.unpin_all(self.pins + self.stale)
        self.pins, self.stale = [], []
        self._finished(False)

    def _finished(self, released: bool) -> None:
        for w in self.ended_by:
            w.finished(self, released)
        self.ended_by = []

    def _let_go(self) -> Work:
        entries, self.pins, self.stale = self.pins + self.stale, [], []
        yield from unpin(self.ctx.objects, entries, self.clock)
        self._finished(False)

    def _run(self) -> Work:
        ctx, eng, keys, msg, clock = self.ctx, self.eng, self.keys, self.msg, self.clock
        yield from probe_l2(ctx.objects, keys, len(eng.layout.groups), clock)
        if not msg.pin:
            n = yield from hit_length_turns(ctx, eng, keys, msg.policy, set(), self.foreign, clock)
            count_hit(ctx, eng, n, 0, probe=True)
            count_foreign(ctx, self.foreign)
            self.answered = True
            ctx.send(self.ident, self.req_id, P.LookupResult(hit_chunks=n, lease=0, objects=[]), ())
            self._finished(False)
            return
        while True:
            n = yield from hit_length_turns(ctx, eng, keys, msg.policy, self.missing, self.foreign, clock)
            got = yield from self._pin_prefix(n)
            if got is None:
                continue  # a miss: the hit is shorter
            entries, locs, complete = got
            if self.loading and not self.waited:
                self.waited = True
                ctx.counters.lookup_l2_waits += 1
            waited = bool(self.loading)
            failed = False
            while self.loading:
                while self.loading and (self.loading[-1].state is not State.LOADING or self.loading[-1].gone):
                    failed = self.loading.pop().gone or failed
                if self.loading:
                    yield WAIT
            if complete and not failed:
                yield from self._answer(n, entries, locs)
                return
            if not waited and not failed:
                yield WAIT  # reads wait for spills to free room: asked again when a worker finishes

    def _pin_prefix(self, n: int) -> Steps[Pinned | None]:
        """Pin the objects a resume at n needs, in retrieve order, reading from L2 those L1 lacks; None at the
        first one that is no longer there for this engine (a miss). First what L1 holds, then the reads: a read
        for this lookup must never evict an object this same lookup needs further down its list."""
        eng, keys, msg, clock, objects = self.eng, self.keys, self.msg, self.clock, self.ctx.objects
        get, ns, lengths, loc = objects.get, eng.ns, eng.object_bytes, P.ObjectLoc
        ready, reserved, loading = State.READY, State.RESERVED, State.LOADING
        self.stale += self.pins
        pins: list[Entry] = []
        self.pins = pins
        locs: list[P.ObjectLoc] = []
        absent = False
        for pairs in resume_slices(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens, SLICE_OBJECTS):
            es = [get((keys[c], g)) for c, g in pairs]
            if None not in es and list(map(_state, es)).count(ready) == len(es) \
                    and list(map(_ns, es)).count(ns) == len(es):  # the common case: one piece pinned in C
                full = cast(list[Entry], es)
                objects.pin_all(full)
                pins += full
                locs += map(loc, [c for c, _ in pairs], [g for _, g in pairs], map(_offset, full), map(_length, full))
            else:
                for (c, g), e in zip(pairs, es, strict=True):
                    if e is None:
                        absent = True
                        continue
                    if e.ns != ns or e.length != lengths[g] or e.state is reserved:
                        self.missing.add((keys[c], g))
                        return None
                    objects.pin(e)
                    pins.append(e)
                    if e.state is loading:
                        self.loading.append(e)
                        self.from_l2.add(c)
                    locs.append(loc(c, g, e.offset, e.length))
            if clock.over():
                yield TURN
        if not absent:
            return pins, locs, True
        self.stale += pins  # held until this pass has pinned them again
        pins = []
        self.pins = pins
        locs = []
        complete = True
        l2 = objects.l2
        for pairs in resume_slices(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens, SLICE_OBJECTS):
            for c, g in pairs:
                oid = (keys[c], g)
                e = get(oid)
                if e is None:
                    if l2 is None or l2.length(keys[c], g, ns) != lengths[g]:
                        self.missing.add(oid)  # evicted since the hit rule saw it, and not in L2
                        return None
                    r = objects.prefetch(oid, ns, lengths[g])
                    if isinstance(r, NoSlot):
                        if r is NoSlot.FULL:  # no room to bring it in: a miss at this length
                            self.missing.add(oid)
                            return None
                        complete = False  # spills will free room
                        continue
                    e = r
                    self.loading.append(e)
                    self.from_l2.add(c)
                elif e.ns != ns or e.length != lengths[g] or e.state is reserved:
                    self.missing.add(oid)
                    return None
                elif e.state is loading:
                    self.loading.append(e)
                    self.from_l2.add(c)
                objects.pin(e)
                pins.append(e)
                locs.append(loc(c, g, e.offset, e.length))
            if clock.over():
                yield TURN
        return pins, locs, complete

    def _answer(self, n: int, entries: list[Entry], locs: list[P.ObjectLoc]) -> Work:
        """Let go of what earlier passes pinned, lease `entries` (this pass's pins, every one READY) and answer."""
        ctx, eng, msg, clock, objects = self.ctx, self.eng, self.msg, self.clock, self.ctx.objects
        stale, self.stale = self.stale, []
        yield from unpin(objects, stale, clock)  # what earlier passes pinned (each object pinned again since)
        raw = yield from encoded_locs(locs, clock)
        lease = ctx.sessions.add_lease(eng, msg.request, entries, locs) if entries else None
        self.pins = []  # the lease holds them now
        count_hit(ctx, eng, n, sum(1 for c in self.from_l2 if c < n), probe=False)
        count_foreign(ctx, self.foreign)
        ctx.counters.bytes_leased += resume_bytes(eng.layout, msg.policy, n, msg.skip_chunks, eng.object_bytes,
                                                  eng.chunk_tokens)
        self.answered = True
        ctx.send(self.ident, self.req_id, P.LookupResult(hit_chunks=n, lease=lease.id if lease else 0,
                                                         objects=cast(Any, raw)), ())
        if self.ended_by and lease is not None:  # its session ended after it was asked: released at once
            ctx.sessions.close_lease(lease)
            yield from unpin(objects, entries, clock)
        self._finished(lease is not None)
