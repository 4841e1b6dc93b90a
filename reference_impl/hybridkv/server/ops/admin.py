"""Handlers for engines and administration: register, unregister, heartbeat, share_cuda, stats, clear, health,
status."""

from __future__ import annotations

import logging
import os
import time

from hybridkv import __version__
from hybridkv.model.keys import namespace
from hybridkv.model.layout import LayoutError
from hybridkv.server.books.records import Engine
from hybridkv.server.books.telemetry import STATUS_FIGURES, limits, server_figures
from hybridkv.server.ops import store
from hybridkv.server.ops.clear import clear as in_turns
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError, no_frames
from hybridkv.server.ops.turns import let_go
from hybridkv.wire import protocol as P

E = P.ErrorCode
log = logging.getLogger("hybridkv.server")


def register(ctx: Context, ident: bytes, msg: P.Register, frames: Frames) -> Answer:
    no_frames(msg, frames)
    layout = msg.layout
    forced = ctx.config.chunk_tokens
    try:
        chunk = msg.chunk_tokens or forced or layout.default_chunk_tokens()
        if forced and chunk != forced:
            raise RequestError(E.LAYOUT, f"this server caches chunks of {forced} tokens; engine asked for {chunk}")
        ns = namespace(layout, msg.tp_rank, chunk, msg.salt)
    except LayoutError as e:
        raise RequestError(E.LAYOUT, str(e)) from None
    sizes = [layout.object_bytes(g, chunk) for g in range(len(layout.groups))]
    alloc = ctx.objects.l1.alloc
    if alloc.rounded(max(sizes)) > alloc.size:
        raise RequestError(E.LAYOUT, f"one object of {max(sizes)} B does not fit in the {alloc.size} B "
                           "L1 arena; start the server with a larger L1 or use smaller chunks")
    eng = ctx.sessions.add_engine(ident, msg.name, layout, ns, chunk, sizes)
    ctx.counters.engines_registered += 1
    return P.Registered(engine=eng.id, namespace=ns, object_bytes=sizes, arena_path=str(ctx.arena.path),
                        arena_bytes=ctx.arena.file_bytes, heartbeat_s=ctx.config.client_timeout_s / 3,
                        l2=ctx.config.has_l2), []


def unregister(ctx: Context, ident: bytes, msg: P.Unregister, frames: Frames) -> Answer:
    no_frames(msg, frames)
    drop_engine(ctx, ctx.sessions.engine(ident, msg.engine), reclaimed=False)
    return P.Done(), []


def heartbeat(ctx: Context, ident: bytes, msg: P.Heartbeat, frames: Frames) -> Answer:
    no_frames(msg, frames)
    ctx.sessions.engine(ident, msg.engine)
    return P.Done(), []


def reclaim_silent(ctx: Context, now: float) -> None:
    """Reclaim every engine silent at `now` (`Sessions.now`)."""
    for eng in ctx.sessions.silent(now):
        log.warning("engine %x (%s) silent for %.1fs: reclaiming its reservations and pins", eng.id, eng.name,
                    now - eng.last_seen)
        ctx.counters.engines_reclaimed += 1
        drop_engine(ctx, eng, reclaimed=True)


def drop_engine(ctx: Context, eng: Engine, reclaimed: bool) -> None:
    """Forget an engine: unpin its leases, free its reservations (both quarantined when it vanished: it may still
    read its leases' objects, and write into its reservations' slots)."""
    leases, reservations = ctx.sessions.remove_engine(eng)
    pinned = [e for lease in leases for e in lease.entries]
    if reclaimed:
        ctx.objects.quarantine_pins(pinned)
        pinned = []
    let_go(ctx, pinned, [lease.locs for lease in leases])
    for res in reservations:
        # a fenced commit waiting for the engine's copies, which may still land: its slots quarantined
        if res.committing and store.end_pending_fence(
                ctx, res, E.UNKNOWN_ENGINE, f"engine {eng.id} was unregistered or reclaimed before the fence word "
                f"of reservation {res.id} showed: nothing of it became visible"):
            continue
        if res.committing:
            res.dead = True  # the copy finishes on its thread, then its slots are freed
            continue
        ctx.objects.discard([s.entry for s in res.slots], quarantine=reclaimed)
        if reclaimed:
            ctx.counters.reservations_reclaimed += 1
        else:
            ctx.counters.objects_aborted += len(res.slots)
    ctx.formats.cuda.forget(eng)


def share_cuda(ctx: Context, ident: bytes, msg: P.ShareCuda, frames: Frames) -> Answer:
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    return P.Done(count=ctx.formats.cuda.share(eng, msg)), []


def stats(ctx: Context, ident: bytes, msg: P.Stats, frames: Frames) -> Answer:
    no_frames(msg, frames)
    _admin_only(ctx, "stats")
    return P.StatsResult(counters=server_figures(ctx)), []


def clear(ctx: Context, ident: bytes, msg: P.Clear, frames: Frames) -> Answer:
    no_frames(msg, frames)
    if msg.engine is None:
        _admin_only(ctx, "clear of every namespace")
        return in_turns(ctx, ident, msg.id, None, None)
    eng = ctx.sessions.engine(ident, msg.engine)
    return in_turns(ctx, ident, msg.id, eng, eng.ns)


def health(ctx: Context, ident: bytes, msg: P.Health, frames: Frames) -> Answer:
    no_frames(msg, frames)
    return P.HealthResult(status="ok", version=__version__, uptime_s=time.monotonic() - ctx.started,
                          pid=os.getpid()), []


def _admin_only(ctx: Context, what: str) -> None:
    if not ctx.config.admin:
        ctx.counters.forbidden_refusals += 1
        raise RequestError(E.FORBIDDEN, f"{what} touches every tenant; this server was started without "
                           "--admin, which opens it to every client of the endpoint")


def status(ctx: Context, ident: bytes, msg: P.Status, frames: Frames) -> Answer:
    """Status: the operator's summary, open to every client (so server-wide totals only)."""
    no_frames(msg, frames)
    tel, now = ctx.telemetry, time.monotonic()
    figures = server_figures(ctx)
    window_s, window = tel.window(now, figures)
    errors: dict[str, int] = {}
    for (_, code), n in tel.errors.items():
        errors[code] = errors.get(code, 0) + n
    return P.StatusResult(version=__version__, pid=os.getpid(), uptime_s=now - ctx.started,
                          figures={k: figures.get(k, 0) for k in STATUS_FIGURES}, limits=limits(ctx),
                          window_s=window_s, window=window, errors=errors,
                          recent_errors=[P.RecentError(now - t, kind, code) for t, kind, code in tel.recent]), []
