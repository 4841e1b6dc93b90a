"""A small client of the cache server: one DEALER socket owned by an I/O thread, futures for replies.

Any thread may submit requests; replies are matched by request id. Payload frames are sent with
copy=False, so a caller's buffer must stay unchanged until its reply arrives. Registered engines are
kept alive by heartbeats from the I/O thread, so a live client is never reclaimed by the server.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future

import msgspec
import zmq

from hybridkv import protocol as P


class ServerError(RuntimeError):
    """The server answered with an Error reply."""

    def __init__(self, code: str, message: str, op: str = ""):
        super().__init__(f"{op}: {code}: {message}" if op else f"{code}: {message}")
        self.code = code
        self.message = message


class ServerTimeout(TimeoutError):
    """No reply within the timeout: the server is gone, stalled, or the endpoint is wrong."""


class CacheClient:
    """Talks to one server endpoint. Thread-safe; close() when done."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, tuple[Future, float, str]] = {}
        self._keepalive: dict[int, float] = {}  # engine id -> interval
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hkv-client", daemon=True)
        self._thread.start()

    # ---- public --------------------------------------------------------------------------------

    def submit(self, msg: P.Message, frames: list | tuple = ()) -> Future:
        """Send `msg` (+ payload frames); the future gives (reply, reply frames) or raises ServerError."""
        if self._closed.is_set():
            raise RuntimeError("client is closed")
        msg.id = next(self._ids)
        fut: Future = Future()
        with self._lock:
            self._pending[msg.id] = (fut, time.monotonic() + self.timeout_s, type(msg).__name__)
        self._out.put((P.encode(msg), frames))
        self._wake()
        return fut

    def call(self, msg: P.Message, frames: list | tuple = (), timeout: float | None = None):
        """submit() and wait: returns (reply, frames); raises ServerError or ServerTimeout."""
        return self.submit(msg, frames).result(timeout=timeout if timeout is not None else self.timeout_s + 5)

    def keepalive(self, engine: int, interval_s: float) -> None:
        """Heartbeat `engine` every interval_s from the I/O thread, until forget(engine)."""
        with self._lock:
            self._keepalive[engine] = interval_s

    def forget(self, engine: int) -> None:
        with self._lock:
            self._keepalive.pop(engine, None)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- I/O thread ----------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat: dict[int, float] = {}
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(timeout=100))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                while True:
                    try:
                        data, frames = self._out.get_nowait()
                    except queue.Empty:
                        break
                    sock.send_multipart([data, *frames], copy=False)
                if sock in events:
                    self._receive(sock)
                self._beat(sock, next_beat)
                self._expire()
        finally:
            sock.close(linger=0)
            self._fail_all(RuntimeError("client closed"))

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = P.decode_reply(frames[0].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not ours to answer; the request it belonged to times out
            with self._lock:
                entry = self._pending.pop(reply.id, None)
            if entry is None:
                continue  # a heartbeat's answer, or a reply that arrived after its timeout
            fut, _, op = entry
            if isinstance(reply, P.Error):
                fut.set_exception(ServerError(reply.code, reply.message, op))
            else:
                fut.set_result((reply, [f.buffer for f in frames[1:]]))

    def _beat(self, sock: zmq.Socket, next_beat: dict[int, float]) -> None:
        now = time.monotonic()
        with self._lock:
            beats = dict(self._keepalive)
        for eng, interval in beats.items():
            if now >= next_beat.get(eng, 0.0):
                sock.send(P.encode(P.Heartbeat(engine=eng, id=0)))
                next_beat[eng] = now + interval

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [(i, e) for i, e in self._pending.items() if e[1] <= now]
            for i, _ in late:
                del self._pending[i]
        for _, (fut, _, op) in late:
            fut.set_exception(ServerTimeout(f"{op}: no reply from {self.endpoint} within {self.timeout_s:g}s"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, _, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)
