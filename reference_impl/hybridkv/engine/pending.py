"""What the cache client keeps per request in flight (`Pending`), its wake-up socket pair (`Wake`), how it
receives one reply (`recv_reply`), and the errors its calls raise."""

from __future__ import annotations

import socket
from concurrent.futures import Future, InvalidStateError

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


class Pending:
    """A request sent and not yet answered. A submit()'s outcome goes to its Future; a call()'s is kept
    here for the waiting caller (no Future, no lock of its own: the caller usually receives it itself)."""
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


def recv_reply(sock: zmq.Socket) -> tuple[P.Reply | None, list]:
    """One queued reply: (the reply, None when it does not decode, and its payload frames). No frame is
    copied, and the reply frame says itself whether payload frames follow (sock.get(RCVMORE) costs
    about a microsecond: pyzmq builds an enum on every call)."""
    head = sock.recv(zmq.NOBLOCK, copy=False)
    frames = sock.recv_multipart(copy=False) if head.more else []
    try:
        return P.decode_reply(head.buffer), frames
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, frames  # not ours to answer; the request it belonged to times out
