"""A KV-event subscriber as a KV-aware router runs one: a ZMQ SUB socket on vLLM's publisher
(`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ..., "topic": ...}'`),
decoding each (topic, sequence, payload) message into vLLM's KVEventBatch."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class KVEventSubscriber:
    """Every event vLLM published on `endpoint` (a publisher that binds: ipc:// or tcp://*:port) under `topic`
    since this subscriber connected, in order."""

    def __init__(self, endpoint: str, topic: str = "", settle_s: float = 0.5):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.connect(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.events: list[Any] = []
        self.seqs: list[int] = []
        time.sleep(settle_s)  # a SUB socket receives only what is published after its subscription arrived

    def poll(self, timeout_s: float = 0.0) -> int:
        """Receive what has arrived (waiting up to `timeout_s` for the first message); how many events came."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        n = 0
        wait_ms = int(timeout_s * 1000)
        while self._sock.poll(wait_ms, zmq.POLLIN):
            _, seq, payload = self._sock.recv_multipart()
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(batch.events)
            n += len(batch.events)
            wait_ms = 0
        return n

    def wait_for(self, done: Callable[[list[Any]], bool], timeout_s: float = 30.0,
                 step: Callable[[], Any] | None = None) -> list[Any]:
        """Poll (calling `step` between polls, e.g. an engine step) until `done(events)`; the events so far.
        TimeoutError when `done` never held."""
        until = time.monotonic() + timeout_s
        while not done(self.events):
            if time.monotonic() > until:
                raise TimeoutError(f"the published KV events never met the condition in {timeout_s:g} s: "
                                   f"{self.events!r}"[:4000])
            if step is not None:
                step()
            self.poll(0.05)
        return self.events

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def of_medium(events: list[Any], medium: str, kind: type | None = None) -> list[Any]:
    """The events of `medium` ('GPU': vLLM's own prefix cache, 'CPU': hybridkv), of class `kind` if given."""
    return [e for e in events if getattr(e, "medium", None) == medium and (kind is None or isinstance(e, kind))]
