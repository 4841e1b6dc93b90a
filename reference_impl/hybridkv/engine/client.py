"""A small client of the cache server: one object that owns the DEALER socket and the book of requests in flight,
shared by the threads that use the client.

A ZMQ socket is not thread-safe, so every use of it is under one lock. A request takes one path: the thread in
`call()` takes the socket, sends, and then *leads*: it polls the socket and hands every reply to the request it
answers, its own included, until its own reply has come. No other thread is woken on that path (two thread
hand-offs per request cost more than the server's work). A request enters the book of requests in flight only
when someone other than its sender may receive its reply: a `submit()` always (its sender does not wait), a
`call()` only once what it polls first is not its own reply (another's reply, a wake-up, IDLE_S passing), so a
lone caller's round trip takes no book lock. Another thread that needs the socket meanwhile asks the leader to
step down (a byte on a wake-up socket) and takes over; the old leader then waits as a follower until its reply is
handed to it or the socket is free again.

The I/O thread sends heartbeats, fails requests past their timeout, and receives for requests whose sender is
not waiting on them in `call()` (those of `submit()`), when no caller leads. Replies are matched by request id.
Payload frames are sent with copy=False, so a caller's buffer must stay unchanged until its reply arrives. A
future's callbacks run on whichever thread received the reply; they may `submit()` but not `call()`.
"""

from __future__ import annotations

import itertools
import math
import select
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

import msgspec
import zmq
from zmq.backend import zmq_poll

from hybridkv.wire import protocol as P

IDLE_S = 0.1  # the longest anyone polls before looking at heartbeats, timeouts and close()
RETRIEVE_WINDOW = 4  # slices of one lease asked ahead of the one received


class ServerError(RuntimeError):
    """The server answered with an Error reply."""

    def __init__(self, code: str, message: str, op: str = ""):
        super().__init__(f"{op}: {code}: {message}" if op else f"{code}: {message}")
        self.code = code
        self.message = message


class ServerTimeout(TimeoutError):
    """No reply within the timeout: the server is gone, stalled, or the endpoint is wrong."""


class Pending:
    """A request sent and not yet answered, as the book keeps it. A submit()'s outcome goes to its Future; a
    call()'s is kept here for the waiting caller (no Future, no lock of its own: the caller usually receives it
    itself)."""
    __slots__ = ("deadline", "op", "future", "done", "reply", "error")

    def __init__(self, deadline: float, op: str, future: Future | None):
        self.deadline, self.op, self.future = deadline, op, future
        self.done = False
        self.reply: tuple[P.Message, list] | None = None
        self.error: BaseException | None = None

    def finish(self, reply: tuple[P.Message, list] | None, error: BaseException | None) -> None:
        if self.future is not None:
            try:
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(reply)
            except InvalidStateError:
                pass  # the submitter cancelled it
        self.reply, self.error, self.done = reply, error, True

    def outcome(self) -> tuple[P.Message, list]:
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


class Wake:
    """A wake-up socket pair: poke() from any thread, the waiting side polls `fd` and drain()s it.
    Socket objects, not raw descriptors: a poke after close() raises instead of writing to a reused fd."""

    def __init__(self) -> None:
        self.r, self.w = socket.socketpair()
        self.r.setblocking(False)
        self.w.setblocking(False)
        self.fd = self.r.fileno()

    def poke(self) -> None:
        try:
            self.w.send(b"w")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed

    def drain(self) -> None:
        try:
            while self.r.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.r.close()
        self.w.close()


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
        self._lock = threading.Lock()       # the book and counts below
        self._turn = threading.Condition(self._lock)  # followers wait here for their reply or the socket
        self._pending: dict[int, Pending] = {}   # the book: request id -> a request someone else may receive for
        self._keepalive: dict[int, float] = {}  # engine id -> interval
        self._unwaited = 0   # pending requests of submit(): someone must receive for them
        self._want = 0       # threads waiting for the socket: a leader steps down for them
        self._followers = 0  # threads in call() waiting while another leads
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hkv-client", daemon=True)
        self._thread.start()

    # ---- public --------------------------------------------------------------------------------

    def submit(self, msg: P.Message, frames: list | tuple = (), reply_soon: bool = True) -> Future:
        """Send `msg` (+ payload frames); the future gives (reply, reply frames) or raises ServerError.

        `reply_soon=False`: nobody waits on the reply (a lease's release, sent before its load is reported done):
        the I/O thread is not woken to receive it, which would take the interpreter from the thread about to wake
        the waiting caller; the next thread that leads receives it, or the I/O thread within IDLE_S. The request
        itself leaves now either way."""
        fut: Future = Future()
        msg.id = next(self._ids)
        entry = Pending(time.monotonic() + self.timeout_s, type(msg).__name__, fut)
        with self._lock:
            if self._closed:
                raise RuntimeError("client is closed")
            self._pending[msg.id] = entry
            self._unwaited += 1
        mine = self._owner == threading.get_ident()  # a reply callback of the leading thread
        if not mine:
            self._take()
        try:
            self._send(msg, frames)
        except BaseException as e:  # a request that cannot be sent fails its own future
            if self._pop(msg.id) is entry:
                entry.finish(None, e)
        finally:
            if not mine:
                self._give(wake_io=reply_soon)
        return fut

    def call(self, msg: P.Message, frames: list | tuple = (), timeout: float | None = None) -> Any:
        """Send and wait: returns (reply, frames); raises ServerError or ServerTimeout (or TimeoutError
        when `timeout` is shorter than the client's and passes first, `timeout` counting for each request sent).

        A Retrieve answers the whole lease (from `first`, 0 when it names none): the server's slices (at most its
        --max-retrieve-objects objects each, so that the other clients are answered between them) are asked for
        and joined. (`submit()` sends a Retrieve as it is given: one slice.)"""
        if isinstance(msg, P.Retrieve):
            return self._retrieve(msg, frames, timeout)
        return self._call(msg, frames, timeout)

    def _retrieve(self, msg: P.Retrieve, frames: list | tuple, timeout: float | None) -> tuple[P.Retrieved, list]:
        """The whole lease: its first slice, which says how many objects it holds, then the rest, RETRIEVE_WINDOW
        slices asked ahead: asked one at a time, the server's send of a slice and our receive of the one before would
        never overlap. Each is a request of its own, so the server reads other clients' requests between them. The
        slices' frames are joined as a list of the frames' buffers: no payload byte is copied here."""
        if msg.first is None:
            msg.first = 0
        reply, got = self._call(msg, frames, timeout)
        if reply.next is None or reply.next >= reply.total:  # one slice (or a server from before paging)
            return reply, got
        total, step, ask = reply.total, max(1, len(reply.objects)), reply.next
        objects, got = list(reply.objects), list(got)
        window: deque[tuple[int, Future]] = deque()
        try:
            while reply.next < total:
                while ask < total and len(window) < RETRIEVE_WINDOW:
                    window.append((ask, self.submit(msgspec.structs.replace(msg, first=ask))))
                    ask += step
                at, fut = window.popleft()
                reply, more = fut.result(timeout if timeout is not None else self.timeout_s + 5)
                # a server that did not move on would have this loop ask forever: a broken server, said so
                if reply.total != total or reply.next is None or not at < reply.next == at + len(reply.objects):
                    raise RuntimeError(f"Retrieve of lease {msg.lease} from {at}: the server answered "
                                       f"{len(reply.objects)} objects, next {reply.next} of {reply.total} "
                                       f"(was {total})")
                objects += reply.objects
                got += more
                if window and window[0][0] != reply.next:  # slices of another size: ask again from this one's end
                    for _, f in window:
                        f.cancel()
                    window.clear()
                    ask = reply.next
        finally:
            for _, f in window:
                f.cancel()  # its reply, if it comes, is dropped
        return P.Retrieved(objects=objects, total=total, next=reply.next, id=msg.id), got

    def _call(self, msg: P.Message, frames: list | tuple, timeout: float | None) -> Any:
        """The one path of a request: take the socket, send, lead until the reply comes (entering the book first if
        anything else comes before it), then, if another thread took the socket over, follow."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("call() from a reply callback would wait on the thread that must receive its reply")
        wait_s = timeout if timeout is not None else self.timeout_s + 5
        now = time.monotonic()
        until = now + wait_s
        deadline = now + self.timeout_s
        lead_until = min(until, deadline)  # a leader polls until its request's deadline, then fails it itself
        msg.id = next(self._ids)
        if self._sock_lock.acquire(blocking=False):
            self._owner = me
        else:
            self._take()
        try:
            self._send(msg, frames)
            got = self._lead(None, lead_until, msg, deadline)
        finally:
            self._give()
        if isinstance(got, Pending):  # another thread took the socket over, or the deadline passed
            return self._follow(got, lead_until, until, wait_s)
        assert got is not None
        reply, reply_frames = got
        if isinstance(reply, P.Error):
            raise ServerError(reply.code, reply.message, type(msg).__name__)
        return reply, [f.buffer for f in reply_frames] if reply_frames else []

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
            self._take()  # a leader sees _closed and steps down
        try:
            self._sock.close(linger=0)
            self._fail_all(RuntimeError("client closed"))
        finally:
            if not mine:
                self._give()
        self._lead_wake.close()
        self._io_wake.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the socket: taking it, sending, receiving -----------------------------------------------

    def _take(self) -> None:
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

    def _give(self, wake_io: bool = True) -> None:
        """Give the socket back; a follower takes it over, else the I/O thread if replies are still owed (unless
        `wake_io` is False: they may wait for its next look, within IDLE_S)."""
        self._owner = 0
        self._sock_lock.release()
        if self._followers:
            with self._turn:
                self._turn.notify_all()
        elif self._unwaited and wake_io:
            self._io_wake.poke()

    def _send(self, msg: P.Message, frames: list | tuple) -> None:
        """Send under the socket lock, waiting for room in the send queue up to the client's timeout. Most
        requests are one small frame: sent without the multipart machinery."""
        if self._closed:
            raise RuntimeError("client closed")
        head = P.encode(msg)
        try:
            if frames:
                self._sock.send_multipart([head, *frames], flags=zmq.NOBLOCK, copy=False)
            else:
                self._sock.send(head, zmq.NOBLOCK)
        except zmq.Again:
            # the server reads nothing (SNDHWM messages queued): wait for room up to this request's timeout
            if not self._sock.poll(self.timeout_s * 1000, zmq.POLLOUT):
                raise ServerTimeout(f"{type(msg).__name__}: {self.endpoint} reads no requests: "
                                    f"the send queue stayed full for {self.timeout_s:g}s") from None
            self._sock.send_multipart([head, *frames], flags=zmq.NOBLOCK, copy=False)

    def _poll_once(self, wait: float) -> tuple[P.Reply | None, list]:
        """Poll the socket and the wake-up up to `wait` s (IDLE_S at most); the reply received, if any.
        One reply per poll: zmq_poll is level-triggered, so the next poll sees any reply still queued
        (cheaper than asking EVENTS after each reply or receiving until zmq.Again)."""
        got: tuple[P.Reply | None, list] = (None, [])
        for what, _ in zmq_poll(self._poll_items, math.ceil(min(wait, IDLE_S) * 1000)):
            if what is self._sock:
                got = self._recv()
            else:
                self._lead_wake.drain()
        return got

    def _recv(self) -> tuple[P.Reply | None, list]:
        """One queued reply: (the reply, None when it does not decode, and its payload frames). No frame is
        copied, and the reply frame says itself whether payload frames follow (sock.get(RCVMORE) costs
        about a microsecond: pyzmq builds an enum on every call)."""
        head = self._sock.recv(zmq.NOBLOCK, copy=False)
        frames = self._sock.recv_multipart(copy=False) if head.more else []
        try:
            return P.decode_reply(head.buffer), frames
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None, frames  # not ours to answer; the request it belonged to times out

    def _lead(self, entry: Pending | None, until: float, unlisted: P.Message | None = None,
              deadline: float = 0.0) -> Pending | tuple[P.Reply, list] | None:
        """Receive for everyone until `entry` is answered (None: until no submit() reply is owed), someone else
        wants the socket, the client closes, or `until`. The caller holds the socket.

        `unlisted`: a call()'s request, sent and not in the book (`entry` None). When the first reply polled is
        its own, that reply is returned and the request never enters the book (no entry, no book lock); anything
        else enters it first, with `deadline` (before another's reply is handed on: its callback may close(); the
        socket is held, so close() cannot have failed the book yet, it fails it holding the socket), and so does
        leaving without its reply. Returns the entry then."""
        while not self._closed and not self._want:
            if entry is not None:
                if entry.done:
                    break
            elif unlisted is None and not self._unwaited:
                break
            wait = until - time.monotonic()
            if wait <= 0:
                break
            reply, frames = self._poll_once(wait)
            if unlisted is not None:
                if reply is not None and reply.id == unlisted.id:
                    return reply, frames
                entry, unlisted = self._enlist(unlisted, deadline), None
            if reply is not None:
                self._hand(reply, frames)
        if unlisted is not None:  # leaving without its reply: whoever leads next hands it over
            entry = self._enlist(unlisted, deadline)
        return entry

    def _enlist(self, msg: P.Message, deadline: float) -> Pending:
        entry = Pending(deadline, type(msg).__name__, None)
        with self._lock:
            self._pending[msg.id] = entry
        return entry

    # ---- the book: handing replies on, following, timeouts ---------------------------------------

    def _hand(self, reply: P.Reply, frames: list) -> None:
        """Finish the request `reply` answers, if it is still in the book."""
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

    def _pop(self, req_id: int) -> Pending | None:
        with self._lock:
            entry = self._pending.pop(req_id, None)
            if entry is not None and entry.future is not None:
                self._unwaited -= 1
        return entry

    def _follow(self, entry: Pending, lead_until: float, until: float, wait_s: float) -> Any:
        """call()'s wait once it has given the socket up, `entry` in the book: follow while another thread leads
        (it hands the reply over), lead again whenever the socket is free; a leader polls until the request's
        deadline (`lead_until`) at most, then fails it itself."""
        while True:
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
                try:
                    self._lead(entry, lead_until)
                finally:
                    self._give()

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
                        self._give()
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
        self._take()
        try:
            if self._closed:
                return
            for eng in due:
                self._sock.send(P.encode(P.Heartbeat(engine=eng, id=0)), flags=zmq.NOBLOCK)
                next_beat[eng] = now + intervals[eng]
            while self._sock.get(zmq.EVENTS) & zmq.POLLIN:  # heartbeat answers, and anything else come in
                reply, frames = self._recv()
                if reply is not None:
                    self._hand(reply, frames)
        except zmq.Again:
            pass  # the server reads nothing: the next beat tries again
        finally:
            self._give()
