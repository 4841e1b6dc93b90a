"""A small client of the cache server: one DEALER socket, shared by the threads that use the client.

A ZMQ socket is not thread-safe, so every use of it is under one lock. A thread in `call()` sends its
request itself and then *leads*: it holds the socket, polls it and hands every reply to the request it
answers, its own included, until its own reply has come. No other thread is woken on that path (two
thread hand-offs per request cost more than the server's work). Another thread that needs
the socket meanwhile asks the leader to step down (a byte on a wake-up socket) and takes over; the old
leader then waits as a follower until its reply is handed to it or the socket is free again. A call() that
finds the socket free sends and polls once without entering its request in the table of pending requests;
only if what comes first is not its reply (another's reply, a wake-up, IDLE_S passing) does it enter it and
go on as above, so a lone caller's round trip takes no table lock.

The I/O thread sends heartbeats, fails requests past their timeout, and receives for requests whose
sender is not waiting on them in `call()` (those of `submit()`), when no caller leads. Replies are
matched by request id. Payload frames are sent with copy=False, so a caller's buffer must stay unchanged
until its reply arrives. A future's callbacks run on whichever thread received the reply; they may
`submit()` but not `call()`.
"""

from __future__ import annotations

import itertools
import math
import select
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq
from zmq.backend import zmq_poll

from hybridkv import protocol as P
from hybridkv.engine.pending import Pending, ServerError, ServerTimeout, Wake, recv_reply

IDLE_S = 0.1  # the longest anyone polls before looking at heartbeats, timeouts and close()


class CacheClient:
    """Talks to one server endpoint. Thread-safe; close() when done."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._sock_lock = threading.Lock()  # every use of self._sock, and self._owner
        self._owner = 0                     # thread id holding _sock_lock
        self._lead_wake = Wake()           # asks the thread polling the socket to step down
        self._io_wake = Wake()             # wakes the I/O thread
        self._poll_items = [(self._sock, zmq.POLLIN), (self._lead_wake.fd, zmq.POLLIN)]  # for zmq_poll
        self._lock = threading.Lock()       # the tables and counts below
        self._turn = threading.Condition(self._lock)  # followers wait here for their reply or the socket
        self._pending: dict[int, Pending] = {}
        self._keepalive: dict[int, float] = {}  # engine id -> interval
        self._unwaited = 0   # pending requests of submit(): someone must receive for them
        self._want = 0       # threads waiting for the socket: a leader steps down for them
        self._followers = 0  # threads in call() waiting while another leads
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hkv-client", daemon=True)
        self._thread.start()

    # ---- public --------------------------------------------------------------------------------

    def submit(self, msg: P.Message, frames: list | tuple = ()) -> Future:
        """Send `msg` (+ payload frames); the future gives (reply, reply frames) or raises ServerError."""
        fut: Future = Future()
        entry = self._register(msg, fut)
        mine = self._owner == threading.get_ident()  # a reply callback of the leading thread
        if not mine:
            self._acquire()
        try:
            self._send(msg, frames, entry)
        finally:
            if not mine:
                self._release()
        return fut

    def call(self, msg: P.Message, frames: list | tuple = (), timeout: float | None = None):
        """Send and wait: returns (reply, frames); raises ServerError or ServerTimeout (or TimeoutError
        when `timeout` is shorter than the client's and passes first)."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("call() from a reply callback would wait on the thread that must receive its reply")
        wait_s = timeout if timeout is not None else self.timeout_s + 5
        if not frames and self._sock_lock.acquire(False):  # the socket is free: the common case, one caller
            return self._call_alone(msg, wait_s, me)
        entry = self._register(msg, None)
        until = time.monotonic() + wait_s
        self._acquire()
        try:
            self._send(msg, frames, entry)
        except BaseException:
            self._release()
            raise
        return self._wait(entry, min(until, entry.deadline), until, wait_s)

    def keepalive(self, engine: int, interval_s: float) -> None:
        """Heartbeat `engine` every interval_s from the I/O thread, until forget(engine)."""
        with self._lock:
            self._keepalive[engine] = interval_s

    def forget(self, engine: int) -> None:
        with self._lock:
            self._keepalive.pop(engine, None)

    def close(self) -> None:
        """Fail every pending request, close the socket and stop the I/O thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io_wake.poke()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        mine = self._owner == threading.get_ident()
        if not mine:
            self._acquire()  # a leader sees _closed and steps down
        try:
            self._sock.close(linger=0)
            self._fail_all(RuntimeError("client closed"))
        finally:
            if not mine:
                self._release()
        self._lead_wake.close()
        self._io_wake.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the socket: taking it, sending, leading -------------------------------------------------

    def _register(self, msg: P.Message, future: Future | None) -> Pending:
        """Give `msg` its id and a pending entry; `future` None: a call() waits on the entry itself."""
        msg.id = next(self._ids)
        entry = Pending(time.monotonic() + self.timeout_s, type(msg).__name__, future)
        with self._lock:
            if self._closed:
                raise RuntimeError("client is closed")
            self._pending[msg.id] = entry
            self._unwaited += future is not None
        return entry

    def _acquire(self) -> None:
        """Take the socket; a thread leading (blocked in poll) steps down for us."""
        if not self._sock_lock.acquire(blocking=False):
            with self._lock:
                self._want += 1
            self._lead_wake.poke()
            try:
                self._sock_lock.acquire()
            finally:
                with self._lock:
                    self._want -= 1
        self._owner = threading.get_ident()

    def _release(self) -> None:
        """Give the socket back; a follower takes it over, else the I/O thread if replies are still owed."""
        self._owner = 0
        self._sock_lock.release()
        if self._followers:
            with self._turn:
                self._turn.notify_all()
        elif self._unwaited:
            self._io_wake.poke()

    def _send(self, msg: P.Message, frames: list | tuple, entry: Pending) -> None:
        """Send under the socket lock; a request that cannot be sent fails its own entry."""
        try:
            if self._closed:
                raise RuntimeError("client closed")
            parts = [P.encode(msg), *frames]
            try:
                self._send_parts(parts)
            except zmq.Again:
                # the server reads nothing (SNDHWM messages queued): wait for room up to this request's timeout
                if not self._sock.poll(self.timeout_s * 1000, zmq.POLLOUT):
                    raise ServerTimeout(f"{entry.op}: {self.endpoint} reads no requests: "
                                        f"the send queue stayed full for {self.timeout_s:g}s") from None
                self._send_parts(parts)
        except BaseException as e:
            if self._pop(msg.id) is entry:
                entry.finish(None, e)

    def _send_parts(self, parts: list) -> None:
        if len(parts) == 1:
            self._sock.send(parts[0], zmq.NOBLOCK)  # most requests: one small frame, no multipart machinery
        else:
            self._sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)

    def _lead(self, entry: Pending | None, until: float) -> None:
        """Receive for everyone until `entry` is answered (None: until no submit() reply is owed), someone
        else wants the socket, the client closes, or `until`. The caller holds the socket."""
        while not self._closed:
            if (entry.done if entry is not None else not self._unwaited) or self._want:
                return
            wait = until - time.monotonic()
            if wait <= 0:
                return
            reply, frames = self._poll_once(wait)
            if reply is not None:
                self._hand(reply, frames)

    def _poll_once(self, wait: float) -> tuple[P.Reply | None, list]:
        """Poll the socket and the wake-up up to `wait` s (IDLE_S at most); the reply received, if any.
        One reply per poll: zmq_poll is level-triggered, so the next poll sees any reply still queued
        (cheaper than asking EVENTS after each reply or receiving until zmq.Again)."""
        got: tuple[P.Reply | None, list] = (None, [])
        for what, _ in zmq_poll(self._poll_items, math.ceil(min(wait, IDLE_S) * 1000)):
            if what is self._sock:
                got = recv_reply(self._sock)
            else:
                self._lead_wake.drain()
        return got

    def _call_alone(self, msg: P.Message, wait_s: float, me: int) -> Any:
        """call() that found the socket free (thread `me` holds it now): send, poll once, and when what comes
        is this request's reply, return it without a pending entry (no table lock, no entry to pop).
        Anything else (another reply, a thread wanting the socket, no reply within IDLE_S) enters the entry
        in the table first and goes on as _wait(), still leading: so every reply is handed to its request,
        the I/O thread's timeouts and close() see this request, and a thread that wants the socket gets it."""
        self._owner = me
        now = time.monotonic()
        until = now + wait_s
        deadline = now + self.timeout_s
        lead_until = min(until, deadline)
        msg.id = req_id = next(self._ids)
        try:
            if self._closed:
                raise RuntimeError("client is closed")
            try:
                self._sock.send(P.encode(msg), zmq.NOBLOCK)
            except zmq.Again:  # the server reads nothing: _send waits for room in the send queue
                reply = None
                entry = self._enlist(req_id, Pending(deadline, type(msg).__name__, None))
                self._send(msg, (), entry)
            else:
                reply, frames = (None, []) if self._want or lead_until <= now else self._poll_once(lead_until - now)
                if reply is None or reply.id != req_id:
                    # entered before another's reply is handed on: its callback may close()
                    entry = self._enlist(req_id, Pending(deadline, type(msg).__name__, None))
                    if reply is not None:
                        self._hand(reply, frames)
                        reply = None
        except BaseException:
            self._release()
            raise
        if reply is None:  # not (yet) this request's reply
            return self._wait(entry, lead_until, until, wait_s)
        self._release()
        if isinstance(reply, P.Error):
            raise ServerError(reply.code, reply.message, type(msg).__name__)
        return reply, [f.buffer for f in frames] if frames else []

    def _wait(self, entry: Pending, lead_until: float, until: float, wait_s: float) -> Any:
        """call()'s wait, holding the socket on entry: lead, or follow while another thread leads.
        A leader polls until its request's deadline (`lead_until`) at most, then fails it itself."""
        leading = True
        while True:
            if leading:
                try:
                    self._lead(entry, lead_until)
                finally:
                    self._release()
                leading = False
            if entry.done:
                return entry.outcome()
            now = time.monotonic()
            self._expire(now)
            if entry.done:
                return entry.outcome()
            if now >= until:
                raise TimeoutError(f"{entry.op}: no reply within {wait_s:g}s (call's timeout)")
            with self._turn:
                self._followers += 1
                try:
                    while (not entry.done and (self._want or self._sock_lock.locked())
                           and (now := time.monotonic()) < until):
                        self._turn.wait(min(until - now, IDLE_S))
                finally:
                    self._followers -= 1
            if not entry.done and not self._want and self._sock_lock.acquire(blocking=False):
                self._owner = threading.get_ident()
                leading = True

    def _receive(self) -> None:
        """Receive one queued reply and hand it to its request."""
        reply, frames = recv_reply(self._sock)
        if reply is not None:
            self._hand(reply, frames)

    def _hand(self, reply: P.Reply, frames: list) -> None:
        """Finish the request `reply` answers, if it is still pending."""
        entry = self._pop(reply.id)
        if entry is None:
            return  # a heartbeat's answer, or a reply that arrived after its timeout
        if isinstance(reply, P.Error):
            entry.finish(None, ServerError(reply.code, reply.message, entry.op))
        else:
            entry.finish((reply, [f.buffer for f in frames]), None)
        if self._followers:
            with self._turn:
                self._turn.notify_all()

    def _enlist(self, req_id: int, entry: Pending) -> Pending:
        """Enter a call()'s entry that _call_alone() sent without one; the caller holds the socket, so close()
        cannot have failed the table's entries yet (it fails them holding the socket)."""
        with self._lock:
            self._pending[req_id] = entry
        return entry

    def _pop(self, req_id: int) -> Pending | None:
        with self._lock:
            entry = self._pending.pop(req_id, None)
            if entry is not None and entry.future is not None:
                self._unwaited -= 1
        return entry

    # ---- I/O thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_beat: dict[int, float] = {}
        idle = select.poll()  # not select.select: a process with many files (vLLM) has descriptors above 1024
        idle.register(self._io_wake.fd, select.POLLIN)
        try:
            while not self._closed:
                if self._unwaited and not self._want and self._sock_lock.acquire(blocking=False):
                    self._owner = threading.get_ident()
                    try:
                        self._lead(None, time.monotonic() + IDLE_S)
                    finally:
                        self._release()
                else:
                    idle.poll(IDLE_S * 1000)
                    self._io_wake.drain()
                self._expire(time.monotonic())
                self._beat(next_beat)
        except Exception:  # never die silently with requests owed: fail them instead
            self._fail_all(RuntimeError("the client's I/O thread failed"))
            raise

    def _beat(self, next_beat: dict[int, float]) -> None:
        now = time.monotonic()
        with self._lock:
            due = [eng for eng, interval in self._keepalive.items() if now >= next_beat.get(eng, 0.0)]
            intervals = {eng: self._keepalive[eng] for eng in due}
        if not due or self._closed:
            return
        self._acquire()
        try:
            if self._closed:
                return
            for eng in due:
                self._sock.send(P.encode(P.Heartbeat(engine=eng, id=0)), flags=zmq.NOBLOCK)
                next_beat[eng] = now + intervals[eng]
            while self._sock.get(zmq.EVENTS) & zmq.POLLIN:  # heartbeat answers, and anything else come in
                self._receive()
        except zmq.Again:
            pass  # the server reads nothing: the next beat tries again
        finally:
            self._release()

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [i for i, e in self._pending.items() if e.deadline <= now]
        for i in late:
            entry = self._pop(i)
            if entry is not None:
                entry.finish(None, ServerTimeout(f"{entry.op}: no reply from {self.endpoint} within "
                                                 f"{self.timeout_s:g}s"))
        if late and self._followers:
            with self._turn:
                self._turn.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._unwaited = 0
        for entry in pending.values():
            entry.finish(None, exc)
        with self._turn:
            self._turn.notify_all()
