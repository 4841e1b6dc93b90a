"""Store: prepare (reserve slots for what the server lacks), commit (make them visible), abort."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from hybridkv.server.books.fences import Pending
from hybridkv.server.books.l1 import NoSlot
from hybridkv.server.books.objects import Held
from hybridkv.server.books.records import Engine, Reservation, Slot
from hybridkv.server.ops import turns
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError, check_keys, no_frames
from hybridkv.server.ops.turns import TURN, TURN_S, Clock, Steps, Work, drive, encoded_locs
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import traits

E = P.ErrorCode


def prepare(ctx: Context, ident: bytes, msg: P.PrepareStore, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    keys = check_keys(msg.keys, ctx.config.max_keys)
    if msg.n_objects > ctx.config.max_keys * len(eng.layout.groups):
        raise RequestError(E.LIMIT, f"{msg.n_objects} objects in one prepare; the limit is "
                           f"{ctx.config.max_keys} keys x {len(eng.layout.groups)} groups")
    if len(eng.reservations) >= ctx.sessions.limits.max_reservations:
        raise RequestError(E.LIMIT, f"engine {eng.id} holds {len(eng.reservations)} open reservations, the "
                           f"limit (--max-reservations {ctx.sessions.limits.max_reservations})")
    op = PrepareOp(ctx, ident, msg, eng, keys)
    if not op.step():
        ctx.park(op)
    return None


# A prepare works TURN_S (turns.py) in one loop turn: a prepare of 200,000 objects then delays another client's
# request by one share (its objects are looked at in pieces of TURN_OBJECTS between clock reads), not by all of it.
TURN_OBJECTS = 256


class PrepareOp:
    """A store reservation that may wait for spills to free L1 space."""

    def __init__(self, ctx: Context, ident: bytes, msg: P.PrepareStore, eng: Engine, keys: list[bytes]):
        self.ctx, self.ident, self.req_id, self.msg, self.eng, self.keys = ctx, ident, msg.id, msg, eng, keys
        self.todo = msg.pairs()  # chunk, group, chunk, group, ... (packed on the wire: no object per pair)
        self.checked = 0  # objects [0, checked) are inside the request and not repeated
        self.checking = True  # until every object was checked
        self.seen: bytearray | None = None  # a flag per (chunk, group), while checking
        self.next = 0  # the next object: each object is reserved once, after all were checked
        self.slots: list[Slot] = []
        self.locs: list[P.ObjectLoc] = []
        self.present: list[tuple[int, int]] = []
        self.refused: list[P.Refusal] = []
        self.foreign = False  # some of its objects are held under another namespace (the request is counted)
        self._encoding: Steps[msgspec.Raw] | None = None  # the answer's locations, encoded in turns when many
        self._clock = Clock()

    def _check(self, todo: Sequence[int], until: float) -> bool:
        """Check objects (all before any is reserved: a bad one refuses the whole request); False when the
        turn is over first. Raises RequestError naming the first bad object."""
        n_keys, n_groups = len(self.keys), len(self.eng.layout.groups)
        if self.seen is None:  # a flag per (chunk, group) asked: no set to grow (a large set's resize is one stop)
            self.seen = bytearray(n_keys * n_groups)
        seen, n = self.seen, len(todo) // 2
        while self.checked < n:
            a, b = 2 * self.checked, 2 * (self.checked + 4 * TURN_OBJECTS)
            for c, g in zip(todo[a:b:2], todo[a + 1:b:2], strict=True):
                if not (0 <= c < n_keys and 0 <= g < n_groups):
                    raise RequestError(E.BAD_REQUEST, f"object (chunk {c}, group {g}) outside {n_keys} keys "
                                       f"x {n_groups} groups")
                i = c * n_groups + g
                if seen[i]:
                    raise RequestError(E.BAD_REQUEST, f"object (chunk {c}, group {g}) listed twice")
                seen[i] = 1
            self.checked += 4 * TURN_OBJECTS
            if self.checked < n and time.perf_counter() > until:
                self.ctx.another_turn = True
                return False
        self.seen, self.checking = None, False
        self.ctx.objects.probe_l2(self.keys, n_groups)  # after the checks: a refused request costs the L2 nothing
        return True

    def step(self) -> bool:
        ctx, eng, objects = self.ctx, self.eng, self.ctx.objects
        if ctx.sessions.engines.get(eng.id) is not eng:
            objects.discard([s.entry for s in self.slots], quarantine=False)
            ctx.fail(self.ident, self.req_id, E.UNKNOWN_ENGINE, f"engine {eng.id} was unregistered or reclaimed "
                     "while this prepare waited")
            return True
        todo = self.todo
        until = time.perf_counter() + TURN_S
        if self.checking and not self._check(todo, until):
            return False
        while self.next < len(todo) // 2:
            if self.next % TURN_OBJECTS == 0 and time.perf_counter() > until:
                ctx.another_turn = True
                return False
            c, g = todo[2 * self.next], todo[2 * self.next + 1]
            oid, length = (self.keys[c], g), eng.object_bytes[g]
            held = objects.held(oid, eng.ns, length)
            if held is Held.MINE:
                self.present.append((c, g))  # delta-aware: no bytes move for what the server holds
            elif held is Held.OTHER:
                # never "present" (another namespace's object would stand in for this one), never written over
                self.refused.append(P.Refusal(c, g, "held under another namespace or length"))
                self.foreign = True
            else:
                r = objects.reserve(oid, eng.ns, length)
                if r is NoSlot.WAIT:
                    return False
                if r is NoSlot.FULL:
                    self.refused.append(P.Refusal(c, g, objects.full_reason()))
                elif not isinstance(r, NoSlot):
                    self.slots.append(Slot(c, g, r))
                    self.locs.append(P.ObjectLoc(c, g, r.offset, r.length))  # made here: no long last turn
            self.next += 1
        slots: Any = self.locs
        if len(self.locs) > turns.BIG_OBJECTS:  # encoded in turns: in the answer's one piece it would hold the loop
            if self._encoding is None:
                self._encoding = encoded_locs(self.locs, self._clock)
            self._clock.until = until
            try:
                next(self._encoding)
                ctx.another_turn = True
                return False
            except StopIteration as done:
                slots = done.value
        rid = fence = 0
        if self.slots:
            try:  # another prepare of this engine, parked meanwhile, may have taken the last reservation
                res = ctx.sessions.add_reservation(eng, self.msg.request, self.slots)
                rid, fence = res.id, res.fence
            except RequestError:
                objects.discard([s.entry for s in self.slots], quarantine=False)
                raise
        ctx.counters.objects_skipped_present += len(self.present)
        ctx.counters.objects_refused += len(self.refused)
        ctx.counters.namespace_refusals += self.foreign
        ctx.send(self.ident, self.req_id, P.Prepared(reservation=rid, slots=slots, present=self.present,
                                                     refused=self.refused, fence=fence), ())
        turns.free_later(ctx, self.locs)  # the answer is on its way: its locations are done with
        return True


def commit(ctx: Context, ident: bytes, msg: P.CommitStore, frames: Frames) -> Answer:
    eng = ctx.sessions.engine(ident, msg.engine)
    res = ctx.sessions.reservation(eng, msg.reservation)
    if msg.fenced:
        return _commit_fenced(ctx, ident, msg, frames, res)
    job = ctx.formats[msg.format].commit(eng, res, msg, list(frames))
    if job is None:
        return _answer(publish(ctx, res, ident, msg.id))
    res.committing = True
    req_id = msg.id

    def done(_: Any, exc: BaseException | None) -> None:
        if res.dead:
            ctx.objects.discard([s.entry for s in res.slots], quarantine=False)
            ctx.fail(ident, req_id, E.UNKNOWN_ENGINE, f"engine {eng.id} was unregistered or reclaimed during "
                     f"the commit of reservation {res.id}: nothing of it became visible")
            return
        if exc is not None:
            ctx.sessions.close_reservation(res)
            ctx.objects.discard([s.entry for s in res.slots], quarantine=False)
            ctx.fail(ident, req_id, E.BAD_PAYLOAD, f"reservation {res.id} aborted: {exc}")
            return
        if (reply := publish(ctx, res, ident, req_id)) is not None:
            ctx.send(ident, req_id, reply, ())

    if not ctx.workers.submit(job, done):
        res.committing = False
        raise RequestError(E.SHUTTING_DOWN, "the server is shutting down")
    return None


def _commit_fenced(ctx: Context, ident: bytes, msg: P.CommitStore, frames: Frames, res: Reservation) -> Answer:
    """A commit sent with its copies: published now if the fence word holds the reservation id, else when it
    does (`check_fences`, between requests), or failed after --client-timeout."""
    no_frames(msg, frames)
    fences = ctx.sessions.fences
    if not traits(msg.format).direct:
        raise RequestError(E.BAD_REQUEST, f"a fenced commit is a commit of a wire that writes the arena itself "
                           f"(shm), not of {msg.format!r}")
    if not res.fence:
        raise RequestError(E.BAD_REQUEST, f"reservation {res.id} has no fence word (Prepared.fence was 0): "
                           "commit it after its copies, unfenced")
    if fences.shown(res.fence, res.id):
        ctx.counters.commits_fenced += 1
        return _answer(publish(ctx, res, ident, msg.id))
    res.committing = True
    fences.wait(res, ident, msg.id, res.fence, ctx.config.client_timeout_s)
    return None


def check_fences(ctx: Context, whole: bool = False) -> None:
    """Publish the pending fenced commits whose word showed; fail those past their deadline. `whole`: publish
    each in this turn whatever its size (at shutdown, when no turn follows)."""
    shown, late = ctx.sessions.fences.ready()
    for p in shown:
        ctx.counters.commits_fenced += 1
        if (reply := publish(ctx, p.res, p.ident, p.req_id, whole)) is not None:
            ctx.send(p.ident, p.req_id, reply, ())
    for p in late:
        ctx.counters.fence_timeouts += 1
        end_fenced(ctx, p, E.BAD_PAYLOAD, f"the fence word of reservation {p.res.id} did not show within "
                   f"{ctx.config.client_timeout_s:g} s (--client-timeout): nothing of it became visible")


def end_pending_fence(ctx: Context, res: Reservation, code: E, message: str) -> bool:
    """End `res`'s fenced commit if it waits for its word (answered with the error, nothing published):
    what an abort, the engine's unregister or reclaim, and shutdown do to it. False when none waits."""
    p = ctx.sessions.fences.drop(res.id)
    if p is None:
        return False
    end_fenced(ctx, p, code, message)
    return True


def end_fenced(ctx: Context, p: Pending, code: E, message: str) -> None:
    """A pending fenced commit that will never publish: its slots are quarantined (the engine's copies may
    still land in them), the commit is answered with the error."""
    ctx.sessions.close_reservation(p.res)
    ctx.objects.discard([s.entry for s in p.res.slots], quarantine=True)
    ctx.counters.objects_aborted += len(p.res.slots)
    ctx.fail(p.ident, p.req_id, code, message)


def _answer(reply: P.Committed | None) -> Answer:
    return None if reply is None else (reply, [])


def publish(ctx: Context, res: Reservation, ident: bytes, req_id: int, whole: bool = False) -> P.Committed | None:
    """Make a committed reservation's objects visible: in this turn when they are few (or `whole`), returning the
    answer; else in turns (PublishOp, parked), None, the answer sent after the last piece."""
    if whole or len(res.slots) <= turns.BIG_OBJECTS:
        entries = [s.entry for s in res.slots]
        ctx.objects.publish(entries)
        return committed(ctx, res, sum(e.length for e in entries))
    op = PublishOp(ctx, res, ident, req_id)
    if not op.step():
        ctx.park(op)
    return None


class PublishOp:
    """A large commit published in turns (in one piece it holds the loop for as long as its objects take).
    Between its turns a lookup finds a prefix of its objects visible (each one's bytes whole: the copies ended or
    the fence showed before the commit got here), i.e. a shorter hit. The reservation stays open and committing
    until the last piece, so an AbortStore or a second CommitStore of it is `unknown_reservation` and an
    EndSession leaves it; an Unregister meanwhile does not stop it (what was committed is published)."""

    answered = False

    def __init__(self, ctx: Context, res: Reservation, ident: bytes, req_id: int):
        self.ctx, self.res, self.ident, self.req_id = ctx, res, ident, req_id
        res.committing = True
        self.clock = Clock()
        self.nbytes = 0
        self._work = self._publish(res.slots)

    def _publish(self, slots: list[Slot]) -> Work:
        # the clock read after every object, not every SLICE_OBJECTS: the commit's objects are chunk-major, so
        # every group's set of READY keys grows past a power of two at the same chunk, and 64 set resizes in
        # one piece would hold the loop (`microbench/loop_share`, 64 groups); the bytes are counted on the way
        # (not in a pass over every slot after the last piece)
        objects, clock = self.ctx.objects, self.clock
        for i, s in enumerate(slots):
            objects.make_ready(s.entry)
            self.nbytes += s.entry.length
            if clock.over() and i + 1 < len(slots):
                objects.spill_ahead()
                yield TURN
        objects.spill_ahead()

    def step(self) -> bool:
        if not drive(self.ctx, self._work, self.clock):
            return False
        self.answered = True
        self.ctx.send(self.ident, self.req_id, committed(self.ctx, self.res, self.nbytes), ())
        return True


def committed(ctx: Context, res: Reservation, nbytes: int) -> P.Committed:
    """The reservation, its objects (`nbytes` in all) published, closed and counted."""
    ctx.sessions.close_reservation(res)
    n = len(res.slots)
    ctx.counters.objects_committed += n
    ctx.counters.bytes_committed += nbytes
    turns.free_later(ctx, res.slots)  # emptied from here on
    return P.Committed(objects=n, bytes=nbytes)


def abort(ctx: Context, ident: bytes, msg: P.AbortStore, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    res = eng.reservations.get(msg.reservation)
    # a fenced commit waiting for copies that failed (or were given up) is answered with the abort
    if res is not None and end_pending_fence(ctx, res, E.UNKNOWN_RESERVATION, f"reservation {res.id} was "
                                             "aborted by its engine before its fence word showed: nothing of it "
                                             "became visible"):
        return P.Done(count=len(res.slots)), []
    res = ctx.sessions.reservation(eng, msg.reservation)
    ctx.sessions.close_reservation(res)
    ctx.objects.discard([s.entry for s in res.slots], quarantine=False)
    ctx.counters.objects_aborted += len(res.slots)
    return P.Done(count=len(res.slots)), []
