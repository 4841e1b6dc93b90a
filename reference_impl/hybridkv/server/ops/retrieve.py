"""Retrieve (payload frames of a lease, per wire format), release, and end of a request's session."""

from __future__ import annotations

from typing import Any

from hybridkv.server.books.records import Lease
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError, no_frames
from hybridkv.server.ops.turns import let_go
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import TRAITS

E = P.ErrorCode


def retrieve(ctx: Context, ident: bytes, msg: P.Retrieve, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    lease = ctx.sessions.lease(eng, msg.lease)
    part = _part(ctx, lease, msg)
    out = ctx.formats[msg.format].retrieve(eng, lease, part, msg)
    reply = _retrieved(lease, part, msg)
    if isinstance(out, list):
        return reply, out
    req_id = msg.id

    def done(payload: Any, exc: BaseException | None) -> None:
        if exc is None:
            ctx.send(ident, req_id, reply, payload)
        else:
            ctx.fail(ident, req_id, E.BAD_REQUEST, f"{msg.format} retrieve failed: {type(exc).__name__}: {exc}")

    if not ctx.workers.submit(out, done):
        raise RequestError(E.SHUTTING_DOWN, "the server is shutting down")
    return None


def _part(ctx: Context, lease: Lease, msg: P.Retrieve) -> slice:
    """The slice of the lease's objects this Retrieve answers: from `first`, at most --max-retrieve-objects of them
    when they leave as frames. The frames of a reply are one multipart message that the loop hands to libzmq in
    one step (a few us a frame) and no other reply can come between them, so the cap bounds how long one client's
    Retrieve keeps every other client waiting. cuda_ipc sends no frame (a worker copies): every object from
    `first` on."""
    n = len(lease.entries)
    cap = n if TRAITS[msg.format].moves == "cuda" else ctx.config.max_retrieve_objects
    if msg.first is None:  # a client from before paging: the whole lease, or an error that says how to page
        if n > cap:
            raise RequestError(E.LIMIT, f"lease {lease.id} holds {n} objects, more than one Retrieve answers "
                               f"(--max-retrieve-objects {cap}): page through it with Retrieve.first (0, then "
                               f"each reply's next)")
        return slice(0, n)
    first = msg.first
    if first != 0 and not 0 <= first < n:
        raise RequestError(E.BAD_REQUEST, f"Retrieve.first {first} is outside lease {lease.id}'s {n} objects "
                           f"(0 to {max(n - 1, 0)})")
    return slice(first, min(first + cap, n))


def _retrieved(lease: Lease, part: slice, msg: P.Retrieve) -> P.Retrieved:
    whole = part.start == 0 and part.stop == len(lease.locs)
    objects = lease.locs if whole else lease.locs[part]
    if msg.first is None:
        return P.Retrieved(objects=objects)
    return P.Retrieved(objects=objects, total=len(lease.locs), next=part.stop)


def _unpin(ctx: Context, lease: Lease) -> None:
    ctx.sessions.close_lease(lease)
    let_go(ctx, lease.entries, [lease.locs])


def release(ctx: Context, ident: bytes, msg: P.Release, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    lease = ctx.sessions.lease(eng, msg.lease)
    _unpin(ctx, lease)
    return P.Done(count=len(lease.entries)), []


def end_session(ctx: Context, ident: bytes, msg: P.EndSession, frames: Frames) -> Answer:
    """Release the request's leases and reservations. A lookup of the request still working (in turns, or waiting
    for L2) was asked before: as in one turn it answers first, its lease is released at once and counted here, and
    this answers after it (EndSessionWait)."""
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    working = [op for op in ctx.parked if getattr(op, "ends_with_session", False) and op.eng is eng  # type: ignore[attr-defined]
               and op.msg.request == msg.request and not op.answered]  # type: ignore[attr-defined]
    count = 0
    for lease in [x for x in eng.leases.values() if x.request == msg.request]:
        _unpin(ctx, lease)
        count += 1
    for res in [x for x in eng.reservations.values() if x.request == msg.request]:
        if res.committing:
            continue  # its commit answers on its own
        ctx.sessions.close_reservation(res)
        ctx.objects.discard([s.entry for s in res.slots], quarantine=False)
        count += 1
    if not working:
        return P.Done(count=count), []
    wait = EndSessionWait(ctx, ident, msg.id, count, working)
    for op in working:
        op.ended_by = [*op.ended_by, wait]  # type: ignore[attr-defined]
    ctx.park(wait)
    return None


class EndSessionWait:
    """The answer of an EndSession that waits for lookups of its request asked before it."""

    def __init__(self, ctx: Context, ident: bytes, req_id: int, count: int, lookups: list[Any]):
        self.ctx, self.ident, self.req_id, self.count = ctx, ident, req_id, count
        self.pending = set(map(id, lookups))

    def finished(self, lookup: object, released: bool) -> None:
        """`lookup` has answered (its lease `released` here) or failed."""
        self.pending.discard(id(lookup))
        self.count += released

    def step(self) -> bool:
        if self.pending:
            return False
        self.ctx.send(self.ident, self.req_id, P.Done(count=self.count), ())
        return True
