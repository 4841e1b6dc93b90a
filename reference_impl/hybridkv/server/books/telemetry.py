"""What the server shows operators: request latencies and error codes recorded on the loop thread, snapshots
of every figure for the metrics endpoint, the figures of the Status reply (`hybridkv status`; `admin.status`
answers it) and the headline log line.

Recording costs the loop one dict insert and one pop per request. The rest is built from the counters the
server keeps anyway: a snapshot when a scrape asks for one, a sample of a few totals once a second for
Status's rates. A snapshot is an immutable object that the loop publishes by assignment, so threads that read
it never touch the loop's tables.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Protocol, get_args

from hybridkv.memory.arena import Arena
from hybridkv.server.books.config import ServerConfig
from hybridkv.server.books.counters import Counters
from hybridkv.server.books.objects import ObjectStore
from hybridkv.server.books.sessions import Sessions
from hybridkv.server.machinery.workers import Workers
from hybridkv.wire import protocol as P

log = logging.getLogger("hybridkv.server")

# Upper bounds of the latency buckets (seconds): a lone lookup answers in tens of microseconds, a commit of
# a large store or a lookup that waits for L2 reads in milliseconds to seconds.
BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
             2.5, 5.0, 10.0)
# The request types, by their tag on the wire: a bounded label set (no request ids, engines or namespaces).
KINDS: dict[type, str] = {cls: cls.__struct_config__.tag for cls in get_args(P.Request)}
UNDISPATCHED = "undispatched"  # a request refused before dispatch (undecodable, version, queue limit)
WINDOW_S = 60.0          # `hybridkv status` shows rates over the last minute
RECENT_ERRORS = 8

# What a Status reply (open to every client) holds: server-wide totals and gauges, nothing per tenant.
STATUS_FIGURES = (
    "requests", "errors", "lookups", "lookup_chunks", "hit_chunks", "lookup_tokens", "hit_tokens", "hit_chunks_l2",
    "probe_hit_chunks", "bytes_committed", "bytes_leased", "objects_committed", "l2_spill_bytes",
    "l2_prefetch_bytes", "l2_spill_failures", "l2_prefetch_failures", "limit_refusals", "forbidden_refusals",
    "namespace_refusals", "engines_reclaimed", "l1_objects", "l1_bytes_used", "l1_capacity_bytes",
    "l1_pinned_objects", "l1_evictions",
    "l2_objects", "l2_bytes", "l2_capacity_bytes", "l2_evictions", "l2_corrupt_removed", "engines", "namespaces",
    "leases", "reservations", "leases_max_engine", "reservations_max_engine", "parked", "arena_bytes")
# The totals whose growth over the last minute a Status reply carries (hit rate, GB/s).
WINDOW_FIGURES = ("requests", "errors", "lookup_chunks", "hit_chunks", "lookup_tokens", "hit_tokens",
                  "bytes_committed", "bytes_leased", "l2_spill_bytes", "l2_prefetch_bytes")
# The headline log line's fields (stable names: log pipelines key on them).
HEADLINE_FIGURES = ("requests", "errors", "lookups", "hit_chunks", "lookup_chunks", "bytes_committed",
                    "bytes_leased", "l1_bytes_used", "l1_capacity_bytes", "l2_bytes", "engines")


@dataclass(slots=True)
class Latency:
    """One request type's latency histogram: counts per bucket of BUCKETS_S (the last is +Inf) and their sum."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every figure at one moment, for readers on other threads."""
    taken: float                                   # time.monotonic() on the loop thread
    figures: dict[str, int | float]                # what Stats reports (server_figures)
    limits: dict[str, int]
    latency: dict[str, tuple[tuple[int, ...], float]]   # request type -> (counts per bucket, sum of seconds)
    errors: dict[tuple[str, str], int]             # (request type, error code) -> error replies sent
    recent_errors: tuple[tuple[float, str, str], ...]   # (monotonic time, request type, code), newest first


class ServerView(Protocol):
    """What the figures are read from: the request handlers' Context (context.py), named here by the parts
    read, so these books do not import the layer that holds them."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def arena(self) -> Arena: ...
    @property
    def sessions(self) -> Sessions: ...
    @property
    def objects(self) -> ObjectStore: ...
    @property
    def workers(self) -> Workers: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def started(self) -> float: ...
    @property
    def parked(self) -> Sized: ...


def server_figures(ctx: ServerView) -> dict[str, int | float]:
    """The counters and gauges of the whole server (Stats reports them; snapshots hold them)."""
    out = ctx.counters.as_dict()
    out.update(ctx.objects.stats())
    engines = ctx.sessions.engines.values()
    out.update(engines=len(ctx.sessions.engines), namespaces=len({e.ns for e in engines}),
               leases=len(ctx.sessions.leases),
               reservations=len(ctx.sessions.reservations),
               leases_max_engine=max((len(e.leases) for e in engines), default=0),
               reservations_max_engine=max((len(e.reservations) for e in engines), default=0),
               parked=len(ctx.parked), workers_inflight=ctx.workers.inflight, arena_bytes=ctx.arena.size,
               uptime_s=time.monotonic() - ctx.started)
    return out


def limits(ctx: ServerView) -> dict[str, int]:
    c = ctx.config
    return {"max_engines": c.max_engines, "max_leases": c.max_leases, "max_reservations": c.max_reservations,
            "max_pending": c.max_pending}


class Telemetry:
    """Latencies and errors recorded by the loop, and the snapshots it publishes for other threads."""

    def __init__(self, headline_s: float = 60.0):
        if not headline_s >= 0:
            raise ValueError(f"headline interval must be >= 0 seconds (0: never), got {headline_s}")
        self.headline_s = headline_s
        self.latency: dict[str, Latency] = {k: Latency() for k in (*KINDS.values(), UNDISPATCHED)}
        self.errors: dict[tuple[str, str], int] = {}
        self.recent: deque[tuple[float, str, str]] = deque(maxlen=RECENT_ERRORS)
        # Requests not answered yet: (routing id, request id) -> (type, start). Bounded: every request is
        # answered or dropped with its client; a client's repeated id only merges two entries into one.
        self._started: dict[tuple[bytes, int], tuple[str, float]] = {}
        self.snapshot: Snapshot | None = None
        # (time, WINDOW_FIGURES totals), one a second over the last WINDOW_S: Status's rates
        self._history: deque[tuple[float, dict[str, int]]] = deque()
        self._published = threading.Condition()
        self._generation = 0
        self.wanted = False  # a reader on another thread asks the loop for a fresh snapshot
        self._next_headline = time.monotonic() + headline_s

    # ---- on the loop thread --------------------------------------------------------------------------

    def begin(self, ident: bytes, msg: P.Message) -> None:
        """A decoded request is dispatched: its latency runs until its reply is sent."""
        self._started[(ident, msg.id)] = (KINDS[type(msg)], time.perf_counter())

    def answered(self, ident: bytes, req_id: int, reply: P.Message) -> None:
        """A reply is sent (at once or later): observe the request's latency, count an error by code."""
        started = self._started.pop((ident, req_id), None)
        kind = UNDISPATCHED
        if started is not None:
            kind, t0 = started
            lat = self.latency[kind]
            dt = time.perf_counter() - t0
            lat.counts[bisect_left(BUCKETS_S, dt)] += 1
            lat.total_s += dt
        if type(reply) is P.Error:
            key = (kind, reply.code)
            self.errors[key] = self.errors.get(key, 0) + 1
            self.recent.appendleft((time.monotonic(), kind, reply.code))

    def publish(self, ctx: ServerView) -> Snapshot:
        """Take a snapshot for readers on other threads (when a scrape asks for one)."""
        snap = Snapshot(time.monotonic(), server_figures(ctx), limits(ctx),
                        {k: (tuple(v.counts), v.total_s) for k, v in self.latency.items()},
                        dict(self.errors), tuple(self.recent))
        with self._published:
            self.snapshot, self.wanted = snap, False
            self._generation += 1
            self._published.notify_all()
        return snap

    def tick(self, ctx: ServerView) -> None:
        """On the loop's timer: sample the totals Status shows rates of (once a second, counters only: no
        adapter is asked for its stats), and log the headline line when it is due."""
        now = time.monotonic()
        history, counters = self._history, ctx.counters
        if not history or now - history[-1][0] >= 1.0:
            history.append((now, {k: getattr(counters, k) for k in WINDOW_FIGURES}))
        while now - history[0][0] > WINDOW_S + 1.0:
            history.popleft()
        if self.headline_s and now >= self._next_headline:
            self._next_headline = now + self.headline_s
            self._headline(server_figures(ctx))

    def window(self, now: float, figures: dict[str, int | float]) -> tuple[float, dict[str, int | float]]:
        """(seconds, growth of WINDOW_FIGURES) since the oldest sample of the last minute."""
        first = next(((t, f) for t, f in self._history if now - t <= WINDOW_S + 1.0), None)
        if first is None:
            return 0.0, {k: 0 for k in WINDOW_FIGURES}
        return now - first[0], {k: figures[k] - first[1][k] for k in WINDOW_FIGURES}

    def _headline(self, f: dict[str, int | float]) -> None:
        fields = {k: f.get(k, 0) for k in HEADLINE_FIGURES}
        rate = f["hit_chunks"] / f["lookup_chunks"] if f["lookup_chunks"] else 0.0
        log.info("headline: %d requests, %d errors, hit rate %.1f%% of %d chunks looked up, L1 %.2f of %.2f GiB, "
                 "%d engines", f["requests"], f["errors"], 100 * rate, f["lookup_chunks"],
                 f["l1_bytes_used"] / 2**30, f["l1_capacity_bytes"] / 2**30, f["engines"],
                 extra={"event": "headline", "fields": fields})

    # ---- on other threads --------------------------------------------------------------------------

    def fresh(self, wake: Callable[[], None], timeout_s: float) -> Snapshot | None:
        """Ask the loop for a snapshot taken now and wait for it; after `timeout_s` (a loop busy for that
        long) the last one (its age is a metric)."""
        with self._published:
            gen = self._generation
            self.wanted = True
            wake()
            self._published.wait_for(lambda: self._generation > gen, timeout_s)
            return self.snapshot
