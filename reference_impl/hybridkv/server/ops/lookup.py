"""Lookup: the hit rule, pins for the hit's objects, and L2 -> L1 reads of those not in L1; one op for every size.

A large lookup (more than BIG_OBJECTS keys x groups) works in turns of TURN_S (turns.py), so that every other
client's request is answered between its turns; a small one runs the same op under a clock that never ends its
turn, and answers in the turn it came in unless it waits for L2 reads or spills.

What another request may change between two turns (or while it waits for workers), and what the lookup does:
- an object it has pinned stays as it is (a pinned READY object is never evicted, dropped or written over), so
  every object is pinned as it is counted; a LOADING one whose L2 read fails is gone, and the lookup starts over;
- an object the hit rule found in an earlier turn may be gone, held under another namespace, or being re-stored
  when the lookup comes to pin it: it is a miss, and the hit rule is asked again without it (as when L1 has no
  room for a read);
- its engine unregistered or reclaimed: answered `unknown_engine`, its pins let go (in turns);
- an EndSession of its request sent after it: this lookup answers first and its lease is released at once,
  counted in that EndSession's answer, which follows (retrieve.end_session): the order of one turn;
- the server shutting down: answered `shutting_down` like every parked request.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, cast

from hybridkv.model.policy import resume_bytes, resume_slices
from hybridkv.server.books.l1 import Entry, NoSlot, ObjectKey, State
from hybridkv.server.books.objects import all_ready
from hybridkv.server.books.records import Engine
from hybridkv.server.machinery.table import SegmentedSet
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError, check_keys, no_frames
from hybridkv.server.ops.hitrule import count_foreign, count_hit, hit_length_turns
from hybridkv.server.ops.turns import (
    BIG_OBJECTS,
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
    unpin_off,
)
from hybridkv.wire import protocol as P

E = P.ErrorCode
_offset, _length = attrgetter("offset"), attrgetter("length")
Pinned = tuple[list[Entry], list[P.ObjectLoc], bool]  # the answer's entries and places, and whether it is complete


def resume_request(ctx: Context, ident: bytes, msg: P.Lookup | P.Prefetch,
                   frames: Frames) -> tuple[Engine, list[bytes]]:
    """The engine and checked keys of a request that resumes a prefix (Lookup, Prefetch), its skip_chunks
    checked too."""
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    keys = check_keys(msg.keys, ctx.config.max_keys)
    if msg.skip_chunks < 0:
        raise RequestError(E.BAD_REQUEST, f"skip_chunks must be >= 0, got {msg.skip_chunks}")
    return eng, keys


def op_clock(eng: Engine, keys: list[bytes]) -> Clock:
    """The clock of a request that resumes a prefix: one that ends its turn every TURN_S when it names more than
    BIG_OBJECTS objects (other clients are answered between its turns), else one that never does."""
    return Clock(endless=len(keys) * len(eng.layout.groups) <= BIG_OBJECTS)


def lookup(ctx: Context, ident: bytes, msg: P.Lookup, frames: Frames) -> Answer:
    eng, keys = resume_request(ctx, ident, msg, frames)
    ctx.counters.lookups += 1
    ctx.counters.lookup_chunks += len(keys)
    ctx.counters.lookup_tokens += len(keys) * eng.chunk_tokens
    if msg.pin:
        ctx.sessions.lease_room(eng)
    op = LookupOp(ctx, ident, msg, eng, keys, op_clock(eng, keys))
    if not op.step():
        ctx.park(op)
    return None


class LookupOp(TurnedOp):
    """A lookup, pinned or not: a generator (`_run`) that yields WAIT while it waits for L2 reads or spills, and
    TURN when its share of a loop turn is spent (turns.py; never for a small one, whose clock never ends a turn)."""

    ends_with_session = True  # an EndSession of its request waits for it (retrieve.end_session)

    kind = "lookup"

    def __init__(self, ctx: Context, ident: bytes, msg: P.Lookup, eng: Engine, keys: list[bytes], clock: Clock):
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
        self.clock = clock
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
            while self.loading:
                while self.loading and (self.loading[-1].state is not State.LOADING or self.loading[-1].gone):
                    self.loading.pop()
                if self.loading:
                    yield WAIT
            if complete and not waited:
                yield from self._answer(n, entries, locs)
                return
            if not waited:
                yield WAIT  # reads wait for spills to free room: asked again when a worker finishes
            # After its reads the hit rule is asked again: meanwhile a read may have failed (its object gone) and
            # another engine may have stored what was missing; the next pass pins the reads' objects READY.

    def _pin_prefix(self, n: int) -> Steps[Pinned | None]:
        """Pin the objects a resume at n needs, in retrieve order, reading from L2 those L1 lacks; None at the
        first one that is no longer there for this engine (a miss). First what L1 holds, then the reads: a read
        for this lookup must never evict an object this same lookup needs further down its list."""
        eng, keys, msg, clock, objects = self.eng, self.keys, self.msg, self.clock, self.ctx.objects
        get, get_many, ns, lengths, loc = objects.get, objects.l1.get_many, eng.ns, eng.object_bytes, P.ObjectLoc
        reserved, loading = State.RESERVED, State.LOADING
        self.stale += self.pins
        pins: list[Entry] = []
        self.pins = pins
        locs: list[P.ObjectLoc] = []
        absent = False
        # Under an endless clock the hit rule was asked in this same turn, and an object it met in L1 under another
        # namespace was a miss to it: every object of the prefix that L1 holds is of this namespace.
        same_turn = clock.endless
        for pairs in resume_slices(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens, SLICE_OBJECTS):
            es = get_many([(keys[c], g) for c, g in pairs])
            if all_ready(es, None if same_turn else ns):  # common: one piece pinned in C
                objects.pin_all(es)
                pins += es
                locs += map(loc, [c for c, _ in pairs], [g for _, g in pairs], map(_offset, es), map(_length, es))
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

    def _refuse(self, message: str) -> Work:
        """Answer `limit` instead of a lease, and let go of this pass's pins (taken off as they go, as the stale's)."""
        ctx = self.ctx
        ctx.counters.limit_refusals += 1
        self.answered = True
        ctx.fail(self.ident, self.req_id, E.LIMIT, message)
        yield from unpin_off(ctx.objects, self.pins, self.clock)
        self._finished(False)

    def _answer(self, n: int, entries: list[Entry], locs: list[P.ObjectLoc]) -> Work:
        """Let go of what earlier passes pinned, lease `entries` (this pass's pins, every one READY) and answer."""
        ctx, eng, msg, clock, objects = self.ctx, self.eng, self.msg, self.clock, self.ctx.objects
        # what earlier passes pinned (each object pinned again since, or past a shorter hit): taken off self.stale as
        # each piece is let go, so that an engine gone between two of these turns finds the rest there (_let_go)
        yield from unpin_off(objects, self.stale, clock)
        # in turns, the places are encoded in pieces (in the reply's one piece they would hold the loop); in one
        # turn they go into the reply as they are, which is cheaper
        raw = locs if clock.endless else (yield from encoded_locs(locs, clock))
        if entries:  # asked when it came too, but lookups of one engine that worked together each found room then
            try:
                ctx.sessions.lease_room(eng)
            except RequestError as e:
                yield from self._refuse(e.message)
                return
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
