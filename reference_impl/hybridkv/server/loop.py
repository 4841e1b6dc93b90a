"""The CPU-only cache server: a ZMQ ROUTER loop over the L1 arena and the L2 adapter.

One thread owns the socket and every table; disk and payload work runs on worker threads that post
completions back through a queue and a wake-up pipe. A request that must wait (an L2 read, a spill
that frees space) is parked and answered later, so no engine waits on another engine's work.
This module never imports torch (the legacy codecs import it on first use).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from hybridkv import protocol as P
from hybridkv.arena import Arena
from hybridkv.server.config import ServerConfig, default_ipc_dir, ensure_private_dir
from hybridkv.server.handlers import RequestError, RequestHandlers
from hybridkv.server.l1 import L1Cache, State

log = logging.getLogger("hybridkv.server")


class CacheServer(RequestHandlers):
    """Serves lookups, stores and retrieves for many engines; see DESIGN.md (Server)."""

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None):
        self.config = config
        self.started = time.monotonic()
        self.arena = Arena(config.l1_bytes, config.l1_dir)
        self.l2 = None
        if config.has_l2:
            from hybridkv.server.l2_fs import FilesystemL2

            try:
                self.l2 = FilesystemL2(config.l2_dir, config.l2_bytes, fsync=config.l2_fsync)
            except BaseException:
                self.arena.close()  # else a bad --l2-dir leaves the arena file in /dev/shm
                raise
        self.l1 = L1Cache(self.arena, config.eviction, self._start_evicting_spill if self.l2 else None,
                          (lambda e: self.l2.length(e.key, e.group) == e.length) if self.l2 else None)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="hkv-io")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = threading.Event()
        self._engines: dict = {}
        self._reservations: dict = {}
        self._leases: dict = {}
        self._cuda_engines: dict = {}  # engine id -> cuda_ipc.MappedEngine (baseline format only)
        self._parked: list = []
        self._quarantine: list[tuple[float, int, int]] = []  # (until, offset, length)
        self._spills_inflight = 0
        self._next_id = 1
        self.counters: dict[str, int] = dict.fromkeys((
            "requests", "errors", "lookups", "lookup_chunks", "hit_chunks", "objects_committed",
            "bytes_committed", "objects_skipped_present", "objects_refused", "objects_aborted",
            "l2_spills", "l2_spill_bytes", "l2_spill_failures", "l2_prefetches", "l2_prefetch_bytes",
            "l2_prefetch_failures", "engines_registered", "engines_reclaimed", "reservations_reclaimed"), 0)
        self._handlers: dict[type, Callable] = {
            P.Register: self._register, P.Unregister: self._unregister, P.Heartbeat: self._heartbeat,
            P.Lookup: self._lookup, P.PrepareStore: self._prepare, P.CommitStore: self._commit,
            P.AbortStore: self._abort, P.Retrieve: self._retrieve, P.Release: self._release,
            P.EndSession: self._end_session, P.Stats: self._stats, P.Clear: self._clear,
            P.Health: self._health, P.ShareCuda: self._share_cuda,
        }

    # ---- loop ----------------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the ROUTER socket; returns the endpoint."""
        ep = self.config.endpoint
        if ep.startswith("ipc://"):
            path = ep[len("ipc://"):]
            parent = os.path.dirname(path) or "."
            if os.path.abspath(parent) == str(default_ipc_dir()):
                ensure_private_dir(default_ipc_dir())
            if os.path.exists(path):
                os.unlink(path)  # a stale socket of a dead server; binding over it would fail
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine reusing its identity takes over
        self._sock.bind(ep)
        return ep

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Run until stop(); then shut down cleanly (in-flight L2 writes finish, arena unlinked)."""
        if self._sock is None:
            self.bind()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if on_ready:
            on_ready()
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=200))
                if self._sock in events:
                    self._drain_socket()
                if self._wake_r in events:
                    self._drain_completions()
                if time.monotonic() >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + min(0.5, self.config.client_timeout_s / 4)
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask the loop to stop (safe from signal handlers and other threads)."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def _shutdown(self) -> None:
        if self.config.flush_on_exit and self.l2 is not None:
            for e in self.l1.entries():
                if e.state is State.READY and not e.spilling and not self.l1.clean(e):
                    e.spilling = True
                    self._submit(self._spill_job, e, self._spill_done)
        self._io.shutdown(wait=True)  # in-flight L2 writes complete: L2 stays consistent
        self._drain_completions()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self.l2 is not None:
            self.l2.close()
        self.arena.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drain_socket(self) -> None:
        for _ in range(256):  # bounded, so completions and timers are never starved
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list) -> None:
        ident = frames[0].bytes
        self.counters["requests"] += 1
        if len(frames) < 2:
            self._send_error(ident, 0, P.ErrorCode.BAD_MESSAGE, "empty message: expected a request frame")
            return
        try:
            msg = P.decode_request(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # A newer client's request may not decode here at all: report the version, not its fields,
            # and echo the id so a client library's waiting future gets the error instead of a timeout.
            v, req_id = P.peek_envelope(frames[1].buffer)
            if v != P.PROTOCOL_VERSION:
                self._send_error(ident, req_id, P.ErrorCode.VERSION,
                                 f"protocol version {v} not supported; this server speaks {P.PROTOCOL_VERSION}")
            else:
                self._send_error(ident, req_id, P.ErrorCode.BAD_MESSAGE, f"undecodable request: {e}")
            return
        if msg.v != P.PROTOCOL_VERSION:
            self._send_error(ident, msg.id, P.ErrorCode.VERSION,
                             f"protocol version {msg.v} not supported; this server speaks {P.PROTOCOL_VERSION}")
            return
        try:
            out = self._handlers[type(msg)](ident, msg, frames[2:])
        except RequestError as e:
            self._send_error(ident, msg.id, e.code, e.message)
            return
        except Exception as e:  # a bug must not take the server down for every other engine
            log.exception("internal error handling %s", type(msg).__name__)
            self._send_error(ident, msg.id, P.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            return
        if out is not None:
            self._send(ident, msg.id, *out)

    def _send(self, ident: bytes, req_id: int, reply: P.Message, frames: list | tuple = ()) -> None:
        reply.id = req_id
        # ROUTER drops (never blocks on) messages to a vanished or stalled peer: no engine stalls another.
        self._sock.send_multipart([ident, P.encode(reply), *frames], copy=False)

    def _send_error(self, ident: bytes, req_id: int, code: str, message: str) -> None:
        self.counters["errors"] += 1
        self._send(ident, req_id, P.Error(code=code, message=message))

    def _submit(self, job: Callable, arg, done: Callable) -> None:
        """Run job(arg) on a worker; done(arg, result, exc) runs later on the loop thread."""
        def run():
            try:
                res, exc = job(arg), None
            except BaseException as e:  # noqa: BLE001 - delivered to the loop, which decides
                res, exc = None, e
            self._done.put((done, arg, res, exc))
            try:
                os.write(self._wake_w, b"c")
            except OSError:
                pass
        self._io.submit(run)

    def _drain_completions(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        progressed = False
        while True:
            try:
                done, arg, res, exc = self._done.get_nowait()
            except queue.Empty:
                break
            done(arg, res, exc)
            progressed = True
        if progressed:
            self._run_parked()

    def _run_parked(self) -> None:
        """Retry parked requests in arrival order; each answers itself when it completes."""
        parked, self._parked = self._parked, []
        for op in parked:
            try:
                if not op.step():
                    self._parked.append(op)
            except RequestError as e:
                self._send_error(op.ident, op.msg.id, e.code, e.message)
        self._spill_ahead()

    def _tick(self) -> None:
        now = time.monotonic()
        for eng in list(self._engines.values()):
            if now - eng.last_seen > self.config.client_timeout_s:
                log.warning("engine %d (%s) silent for %.1fs: reclaiming its reservations and pins",
                            eng.id, eng.name, now - eng.last_seen)
                self.counters["engines_reclaimed"] += 1
                self._drop_engine(eng, reclaimed=True)
        keep = []
        for until, offset, length in self._quarantine:
            if until <= now:
                self.l1.alloc.free(offset, length)
            else:
                keep.append((until, offset, length))
        self._quarantine = keep
        self._run_parked()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
