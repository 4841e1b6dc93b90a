"""Retrieve (payload frames of a lease, per wire format), release, and end of a request's session."""

from __future__ import annotations

from typing import Any

from hybridkv.server.books.records import Lease
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError, no_frames
from hybridkv.server.ops.turns import let_go
from hybridkv.wire import protocol as P

E = P.ErrorCode


def retrieve(ctx: Context, ident: bytes, msg: P.Retrieve, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    lease = ctx.sessions.lease(eng, msg.lease)
    out = ctx.formats[msg.format].retrieve(eng, lease, msg)
    if isinstance(out, list):
        return P.Retrieved(objects=lease.locs), out
    req_id = msg.id

    def done(payload: Any, exc: BaseException | None) -> None:
        if exc is None:
            ctx.send(ident, req_id, P.Retrieved(objects=lease.locs), payload)
        else:
            ctx.fail(ident, req_id, E.BAD_REQUEST, f"{msg.format} retrieve failed: {type(exc).__name__}: {exc}")

    if not ctx.workers.submit(out, done):
        raise RequestError(E.SHUTTING_DOWN, "the server is shutting down")
    return None


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
