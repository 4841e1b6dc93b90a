"""A ZMQ forwarder between vLLM's connector and a cache server that injects a fault at an exact moment.

Engines connect to the proxy's ROUTER; each engine connection gets a DEALER of its own to the server, so the
server still sees one connection per engine. `arm(action)` runs `action` (SIGKILL or SIGSTOP the server, say)
right before the next lookup answer with a hit reaches vLLM's scheduler: the scheduler has accepted the hit,
the worker's load has not started. Bytes are forwarded unchanged (the shm arena is mapped directly)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq
from hybridkv.wire import protocol as P


class FaultProxy:
    """Forward frames both ways on a thread; close() stops it."""

    def __init__(self, front: str, back: str):
        self.front, self.back = front, back
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(front)
        self._dealers: dict[bytes, zmq.Socket] = {}
        self._owner: dict[zmq.Socket, bytes] = {}
        self._scheduler: set[bytes] = set()  # connections that registered as vLLM's scheduler
        self._armed: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self.fired = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()

    def arm(self, action: Callable[[], None]) -> None:
        """Run `action` before the next hit reaches the scheduler (once)."""
        with self._lock:
            self.fired.clear()
            self._armed = action

    def _dealer(self, ident: bytes) -> zmq.Socket:
        d = self._dealers.get(ident)
        if d is None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(self.back)
            self._dealers[ident] = d
            self._owner[d] = ident
        return d

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(50):
                if sock is self._router:
                    ident, *frames = self._router.recv_multipart()
                    try:
                        msg = P.decode_request(frames[0])
                        if isinstance(msg, P.Register) and msg.name.startswith("vllm-scheduler"):
                            self._scheduler.add(ident)
                    except Exception:
                        pass  # not ours to judge: the server answers it
                    new = ident not in self._dealers
                    d = self._dealer(ident)
                    if new:
                        poller.register(d, zmq.POLLIN)
                    d.send_multipart(frames)
                else:
                    frames = sock.recv_multipart()
                    ident = self._owner[sock]
                    if ident in self._scheduler:
                        self._maybe_fire(frames[0])
                    self._router.send_multipart([ident, *frames])

    def _maybe_fire(self, frame: bytes) -> None:
        try:
            reply = P.decode_reply(frame)
        except Exception:
            return
        if isinstance(reply, P.LookupResult) and reply.hit_chunks > 0:
            with self._lock:
                action, self._armed = self._armed, None
            if action is not None:
                action()
                self.fired.set()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        for d in self._dealers.values():
            d.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()
