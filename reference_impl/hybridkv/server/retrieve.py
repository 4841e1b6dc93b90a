"""Retrieve (payload frames of a lease, per wire format), release, and end of a request's session."""

from __future__ import annotations

from typing import Any

from hybridkv import protocol as P
from hybridkv.server.context import Answer, Context, Frames, RequestError, no_frames
from hybridkv.server.sessions import Lease

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
    ctx.objects.unpin_all(lease.entries)


def release(ctx: Context, ident: bytes, msg: P.Release, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    lease = ctx.sessions.lease(eng, msg.lease)
    _unpin(ctx, lease)
    return P.Done(count=len(lease.entries)), []


def end_session(ctx: Context, ident: bytes, msg: P.EndSession, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
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
    return P.Done(count=count), []
