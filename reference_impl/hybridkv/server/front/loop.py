"""The CPU-only cache server: a ZMQ ROUTER loop that decodes requests and dispatches them to handlers.

One thread owns the socket and every table; disk and payload work runs on worker threads whose
completions come back through a wake-up pipe. A request that must wait (an L2 read, a spill that
frees space) is parked and answered later, so no engine waits on another engine's work.
This module never imports torch (the legacy codecs import it on first use).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from zmq.backend import zmq_poll

from hybridkv.memory.arena import Arena, remove_dead_arenas
from hybridkv.server.books.config import ServerConfig
from hybridkv.server.books.counters import Counters
from hybridkv.server.books.fences import Fences, fence_region_bytes
from hybridkv.server.books.formats import Formats
from hybridkv.server.books.objects import ObjectStore
from hybridkv.server.books.sessions import STALLED_S, SessionLimits, Sessions
from hybridkv.server.books.telemetry import Telemetry
from hybridkv.server.front.connections import ConnectionGate, bind_gated
from hybridkv.server.front.lifecycle import claim_ipc_path, refuse_meanwhile, refuse_queued, refuse_until_quiet
from hybridkv.server.front.routing_ids import unpredictable_routing_ids
from hybridkv.server.l2.base import L2Adapter
from hybridkv.server.machinery.heap import LARGE_FRAME, HeapTrim
from hybridkv.server.machinery.workers import Workers
from hybridkv.server.ops import admin, lookup, prefetch, retrieve, store
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError
from hybridkv.server.ops.turns import TURN_S, let_go
from hybridkv.wire import protocol as P

log = logging.getLogger("hybridkv.server")
E = P.ErrorCode

# The handler of each request type, found by the decoded message's exact type (the decoder builds no subclass):
# one dict lookup, the same for every type, where a match over the union would test the types in turn.
HANDLERS: dict[type, Callable[[Context, bytes, Any, Frames], Answer]] = {
    P.Register: admin.register, P.Unregister: admin.unregister, P.Heartbeat: admin.heartbeat,
    P.Lookup: lookup.lookup, P.Prefetch: prefetch.prefetch, P.PrepareStore: store.prepare,
    P.CommitStore: store.commit, P.AbortStore: store.abort, P.ShareCuda: admin.share_cuda,
    P.Retrieve: retrieve.retrieve, P.Release: retrieve.release, P.EndSession: retrieve.end_session,
    P.Stats: admin.stats, P.Clear: admin.clear, P.Health: admin.health, P.Status: admin.status,
}


# CPython's full collection walks every tracked object, whoever made it. The L1's and the L2 index's objects, and the
# tables and queues that hold them, are not tracked (gc=False entries in plain dicts keyed by bytes or by entry); the
# READY key sets are (table.SegmentedSet). A full collection still walks those sets, and at a million objects that is
# a stop of the loop a request would feel (`microbench/gc_pause` times it). So full collections run only in a tick
# that found the server idle (no request since the last tick, none parked), at most this often; the young generation
# every tick.
FULL_GC_EVERY_S = 60.0
# how long the last answers may take to leave at shutdown: the exit waits for them (the context's term) and no longer
# than this for a client that does not read; 500 ms lost answers to a client starved of CPU on a loaded machine
SHUTDOWN_LINGER_MS = 5000
FULL_GC_BUSY_S = 600.0  # a server never idle still frees old reference cycles this often
RECLAIM_DRAIN_S = 0.25  # before a reclaim, the requests queued are read for up to this long (heartbeats among them)


class CacheServer:
    """Serves lookups, stores and retrieves for many engines; see docs/protocol.md."""

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None, telemetry: Telemetry | None = None):
        self.config = config
        self.started = time.monotonic()
        for path in remove_dead_arenas(config.l1_dir):
            log.info("removed the arena of a dead server: %s", path)
        self.arena = Arena(config.l1_bytes, config.l1_dir, fence_bytes=fence_region_bytes(config.l1_bytes),
                           sealed=config.l1_memfd)
        try:  # from here on, any failure (a bad --l2-dir, SIGTERM during start) must remove the arena
            l2: L2Adapter | None = config.l2.open() if config.l2 is not None else None
            self.workers = Workers(config.io_threads)
            self.counters = Counters()
            self.sessions = Sessions(SessionLimits(config.max_engines, config.max_engines_per_client,
                                                   config.max_leases, config.max_reservations),
                                     config.client_timeout_s, Fences(self.arena), self.counters)
            self.objects = ObjectStore(config, self.arena, l2, self.workers, self.counters, self.sessions.now)
            self.ctx = Context(config, self.arena, self.sessions, self.objects, self.workers, self.counters,
                               Formats(self.objects.loans, config.cuda_ipc), self.started, self._send_later,
                               telemetry=telemetry or Telemetry())
            self.telemetry = self.ctx.telemetry
        except BaseException:
            self.arena.close()
            raise
        # its own context unless given one: at exit its term() is what waits for the last answers to leave (a process
        # that exits with the context open drops what libzmq still queues, whatever the linger)
        self._own_zctx = context is None
        self._zctx = context or zmq.Context()
        self._sock: zmq.Socket | None = None
        self._gate: ConnectionGate | None = None  # the connection cap
        self._pending: dict[bytes, int] = {}  # requests answered later, per client
        self._stopping = False
        self._closed = False
        self._requests_seen = 0       # requests counted at the last tick: none since means idle
        self._full_gc_at = time.monotonic()
        self.heap = HeapTrim()            # gives the heap back after large requests (heap.py says why)

    # ---- lifecycle -----------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the ROUTER socket (refusing a live server's ipc endpoint); returns the endpoint."""
        ep = self.config.endpoint
        if ep.startswith("ipc://"):
            claim_ipc_path(ep[len("ipc://"):])
        unpredictable_routing_ids()  # its first made-up routing id is drawn as it is made (routing_ids.py)
        sock = self._zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a connection must never take over another's routing id, which is what
        # engines, reservations and leases are bound to.
        sock.setsockopt(zmq.SNDHWM, self.config.max_queued_replies)
        sock.setsockopt(zmq.RCVHWM, self.config.max_pending)
        # libzmq refuses a larger frame before allocating it, and drops the connection that sent it.
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.config.max_frame_bytes, self.config.max_message_bytes))
        sock.copy_threshold = self.objects.loans.copy_threshold  # smaller frames copied when sent, larger lent
        try:  # behind the connection cap, on ipc and tcp (connections.py)
            self._gate = bind_gated(sock, ep, self.config.max_clients, self.config.io_threads)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        return ep

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Run until stop(); then shut down cleanly (in-flight L2 writes finish, arena unlinked)."""
        thresholds = gc.get_threshold()
        try:
            if self._sock is None:
                self.bind()
            assert self._sock is not None
            sock, wake_r, gate = self._sock, self.workers.wake_r, self._gate
            # zmq_poll's own list (a socket and a pipe's fd): no Poller, no dict of its answer
            items: list[tuple[Any, int]] = [(sock, zmq.POLLIN), (wake_r, zmq.POLLIN)]
            if gate is not None:
                items.append((gate.monitor, zmq.POLLIN))
            gc.freeze()  # what start made lives as long as the server: no collection needs to walk it
            gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
            if on_ready:
                on_ready()
            ctx, sessions = self.ctx, self.sessions
            fences = sessions.fences
            next_tick = sessions.ran_at = time.monotonic()
            while not self._stopping:
                # One request per turn: the next poll finds any request still queued at once (its first pass
                # does not wait), so a busy socket costs one poll a request, as a drain loop's poll(0) did,
                # and a lone request (the latency case) costs one poll instead of two; completions and
                # timers are looked at between any two requests.
                # a fenced commit pending: its word is looked at after every poll, which then does not wait
                events = zmq_poll(items, 0 if ctx.another_turn or fences.pending else 200)
                now = time.monotonic()
                if now - sessions.ran_at > STALLED_S:
                    sessions.ran(now)  # the server did not run: nobody's silence counts it
                sessions.ran_at = now
                for what, _ in events:
                    if what is sock:
                        self._receive()
                        if ctx.another_turn:
                            self._receive_queued()
                    elif gate is not None and what is gate.monitor:
                        gate.drain()
                    elif self.workers.drain() + ctx.objects.loans.take_back():  # both wake the loop alike
                        self._run_parked()
                if fences.pending:
                    store.check_fences(ctx)
                    if not events and fences.pending and (nap := fences.nap_s()):
                        time.sleep(nap)
                if ctx.another_turn:  # a large request goes on after every other client had its turn
                    ctx.another_turn = False
                    # What its last turn made young is collected now, a turn's worth: moving many objects into new
                    # eviction segments allocates almost nothing the collector counts, so its next collection would
                    # come late and walk them all at once (and again one generation up)
                    gc.collect(1)
                    self._run_parked()
                if self.telemetry.wanted:  # a scrape waits for a snapshot (metrics_http)
                    self.telemetry.publish(self.ctx)
                if now >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + min(0.5, self.config.client_timeout_s / 4)
        finally:
            gc.set_threshold(*thresholds)
            self.close()

    def stop(self) -> None:
        """Ask the loop to stop (safe from signal handlers and other threads)."""
        self._stopping = True
        self.workers.wake()

    def close(self) -> None:
        """Release everything; the arena file is removed whatever fails before. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.objects.shutting_down()
        try:
            self._refuse_waiting()
            if self.config.flush_on_exit:
                self.objects.flush()
            # in-flight L2 writes complete (L2 stays consistent); what arrives meanwhile is refused
            self.workers.close(meanwhile=lambda: refuse_meanwhile(self._sock, self.workers.wake_r, self._refuse))
        except Exception:
            log.exception("error while finishing L2 writes at shutdown")
        finally:
            try:
                if self._gate is not None:
                    self._gate.close()
                if self._sock is not None:
                    refuse_until_quiet(self._sock, self._refuse)
                    # long enough for the last answers to leave; a client that does not read loses them
                    self._sock.close(linger=SHUTDOWN_LINGER_MS)
                    self._sock = None
                if self._own_zctx:
                    self._zctx.term()  # returns once the answers queued left, or the linger ran out
                self.objects.close()
            except Exception:
                log.exception("error while closing the socket or L2 at shutdown")
            finally:
                self.arena.close()
                self.workers.release()

    def _refuse_waiting(self) -> None:
        """Answer `shutting_down` to every request that would otherwise never be answered: parked ones, and
        those still queued in the socket, so their clients stop waiting now instead of at their timeout.
        (Requests on a worker are answered as they complete, while the pool finishes.)"""
        parked, self.ctx.parked[:] = self.ctx.parked[:], []
        for op in parked:
            if not getattr(op, "answered", False):  # a prefetch whose reads still run has answered already
                self.ctx.fail(op.ident, op.req_id, E.SHUTTING_DOWN, "the server is shutting down")
        if self.sessions.fences.pending:
            store.check_fences(self.ctx, whole=True)  # what showed is published (a flush at exit then writes it to L2)
            for p in list(self.sessions.fences.pending.values()):
                store.end_pending_fence(self.ctx, p.res, E.SHUTTING_DOWN, "the server is shutting down")
        refuse_queued(self._sock, self._refuse)

    def _refuse(self, ident: bytes, req_id: int) -> None:
        self._error(ident, req_id, E.SHUTTING_DOWN, "the server is shutting down")

    # ---- requests --------------------------------------------------------------------------------

    def _receive(self) -> None:
        """Receive one queued message (the poll said readable) and answer it."""
        sock = self._sock
        assert sock is not None
        try:
            # every frame zero-copy: a frame says itself whether another follows (sock.get(RCVMORE) costs a
            # microsecond on every call); the routing id is copied to bytes (at most 255 B) for the tables
            first = sock.recv(zmq.NOBLOCK, copy=False)
            head = sock.recv(zmq.NOBLOCK, copy=False) if first.more else None
            payload = sock.recv_multipart(zmq.NOBLOCK, copy=False) if head is not None and head.more else []
        except zmq.Again:
            return
        try:
            self._handle(first.bytes, head.buffer if head is not None else None, payload)
        except Exception:  # the loop survives anything a socket delivers
            log.exception("internal error handling a message")

    def _receive_queued(self, for_s: float = TURN_S) -> None:
        """While a large request waits for its next turn: answer the requests queued meanwhile first, for up to
        TURN_S, so that each of many clients waits one of its turns, not one turn per request queued before it.
        (Also before a reclaim, for longer.)"""
        sock = self._sock
        assert sock is not None
        until = time.perf_counter() + for_s
        while cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN and time.perf_counter() < until:
            self._receive()

    def _handle(self, ident: bytes, head: memoryview | None, payload: list[zmq.Frame]) -> None:
        self.counters.requests += 1
        if head is None:
            self._error(ident, 0, E.BAD_MESSAGE, "empty message: expected a request frame")
            return
        if len(head) > self.config.max_message_bytes:
            # the envelope decoder skips every other field in C: cheap, and the client gets its answer
            self._error(ident, P.peek_envelope(head)[1], E.LIMIT, f"request frame of {len(head)} B; the limit is "
                        f"{self.config.max_message_bytes} B (--max-message-bytes)")
            return
        if len(head) >= LARGE_FRAME:  # a compare per request; the trim waits for a quiet tick
            self.heap.owed = True
        try:
            msg = P.decode_request(head)
        except P.BadMessage as e:
            # A newer client's request may not decode here at all: report the version, not its fields,
            # and echo the id so a client library's waiting future gets the error instead of a timeout.
            v, req_id = P.peek_envelope(head)
            self.counters.bad_messages += 1
            if v != P.PROTOCOL_VERSION:
                self._error(ident, req_id, E.VERSION,
                            f"protocol version {v} not supported; this server speaks {P.PROTOCOL_VERSION}")
            else:
                self._error(ident, req_id, E.BAD_MESSAGE, f"undecodable request: {e}")
            return
        if msg.v != P.PROTOCOL_VERSION:
            self._error(ident, msg.id, E.VERSION,
                        f"protocol version {msg.v} not supported; this server speaks {P.PROTOCOL_VERSION}")
            return
        if len(payload) > self.config.max_keys * 8:
            self._error(ident, msg.id, E.LIMIT, f"{len(payload)} payload frames in one message")
            return
        pending = self._pending.get(ident, 0)
        if pending >= self.config.max_pending:
            self.counters.limit_refusals += 1
            self._error(ident, msg.id, E.LIMIT, f"{pending} requests of this client still being answered; the "
                        f"limit is {self.config.max_pending} (--max-pending): read the replies first")
            return
        # Counted before dispatch: a handler may answer "later" before it even returns (a parked op
        # whose first step completes), and that answer takes the count down again.
        self._pending[ident] = pending + 1
        self.telemetry.begin(ident, msg)
        try:
            out = self._dispatch(ident, msg, payload)
        except RequestError as e:
            if e.code is E.LIMIT:
                self.counters.limit_refusals += 1
            self._answered(ident)
            self._error(ident, msg.id, e.code, e.message)
            return
        except Exception as e:  # a bug must not take the server down for every other engine
            log.exception("internal error handling %s", type(msg).__name__)
            self._answered(ident)
            self._error(ident, msg.id, E.INTERNAL, f"{type(e).__name__}: {e}")
            return
        if out is not None:
            self._answered(ident)
            self._send(ident, msg.id, *out)

    def _dispatch(self, ident: bytes, msg: P.Request, frames: Frames) -> Answer:
        handler = HANDLERS.get(type(msg))
        if handler is None:
            raise RequestError(E.BAD_MESSAGE, f"no handler for {type(msg).__name__}")
        return handler(self.ctx, ident, msg, frames)

    def _send(self, ident: bytes, req_id: int, reply: P.Message, frames: Frames = ()) -> None:
        assert self._sock is not None
        reply.id = req_id
        self.telemetry.answered(ident, req_id, reply)
        # ROUTER drops (never blocks on) messages to a vanished peer or one over its send high-water
        # mark: a client that does not read its replies costs at most max_queued_replies of them.
        if frames:
            self._sock.send_multipart([ident, P.encode(reply), *frames], copy=False)
        else:  # most replies: two small frames, without the multipart machinery
            self._sock.send(ident, zmq.SNDMORE)
            self._sock.send(P.encode(reply))

    def _answered(self, ident: bytes) -> None:
        n = self._pending.get(ident, 0) - 1
        if n > 0:
            self._pending[ident] = n
        else:
            self._pending.pop(ident, None)

    def _send_later(self, ident: bytes, req_id: int, reply: P.Message, frames: Frames) -> None:
        """A deferred answer: the client has one request fewer pending."""
        self._answered(ident)
        if self._sock is not None:  # until the socket closes: answers of work finishing at shutdown still go
            self._send(ident, req_id, reply, frames)

    def _error(self, ident: bytes, req_id: int, code: E, message: str) -> None:
        self.counters.errors += 1
        self._send(ident, req_id, P.Error(code=code, message=message))

    def _run_parked(self) -> None:
        """Retry parked requests in arrival order; each answers itself when it completes."""
        parked = self.ctx.parked[:]
        self.ctx.parked.clear()
        for op in parked:
            try:
                if not op.step():
                    self.ctx.parked.append(op)
            except RequestError as e:
                self.ctx.fail(op.ident, op.req_id, e.code, e.message)
            except Exception as e:
                log.exception("internal error in a parked request")
                self.ctx.fail(op.ident, op.req_id, E.INTERNAL, f"{type(e).__name__}: {e}")
        self.objects.spill_ahead()

    def _tick(self) -> None:
        if self.config.parent_pid and os.getppid() != self.config.parent_pid:
            # reparented: whoever started us is gone (a new pid cannot be mistaken for it, unlike kill(pid, 0))
            log.warning("the process that started the server (pid %d) is gone: stopping", self.config.parent_pid)
            self.stop()
            return
        now = time.monotonic()
        ran = self.sessions.ran(now)  # the sessions' clock: a stop after this reading ages nobody here
        if self.sessions.silent(ran):
            self._receive_queued(RECLAIM_DRAIN_S)  # heartbeats queued behind other requests count first
            admin.reclaim_silent(self.ctx, ran)
        if held := self.objects.pins_out_of_quarantine(ran):
            let_go(self.ctx, held)
        self.objects.tick(now, ran)
        # The young generation, every tick: storing an object allocates one tracked tuple (its oid), evicting one frees
        # one, so the collector's count stays flat and its young collection comes when something else moves it,
        # walking every oid made since in one stop; a tick's worth is small.
        gc.collect(0)
        idle = self.counters.requests == self._requests_seen and not self.ctx.parked
        self._requests_seen = self.counters.requests
        if now - self._full_gc_at >= (FULL_GC_EVERY_S if idle else FULL_GC_BUSY_S):
            gc.collect()
            self._full_gc_at = now
        if self._gate is not None:
            self._gate.resync()
        self._run_parked()
        self.heap.tick(self.sessions.released_objects, quiet=not self.ctx.parked)
        self.telemetry.tick(self.ctx)
