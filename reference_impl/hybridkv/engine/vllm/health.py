"""One view of the cache server's health for both halves of the connector.

A side that lost its connection (a lookup timed out, the server answered `unknown_engine` after a restart) does
not leave the server alone for a fixed time: a thread of its own probes it with `Health` (one small request per
`PROBE_S`; a stopped server answers the queued probes the moment it resumes, a restarted one as soon as it
binds) and registers again the moment it answers. Only a server that answers and refuses the registration
(another chunk size, its engine limit) is left alone for `retry_s`.

Each worker reports its connection's state to the scheduler side through vLLM's worker-to-scheduler channel
(`KVConnectorOutput.kv_connector_worker_meta`, `WorkerHealth`); the scheduler side offers no hit while a rank
reports one it cannot load (`REFUSED`). A rank that is only reconnecting (`DOWN`) is no reason to withhold a
hit: the scheduler's own lookup answered shows the server answers, the rank registers again within a round
trip, and a load that arrives meanwhile waits for that registration (`lookup_timeout_s` at most).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, Literal, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P

log = logging.getLogger(__name__)

PROBE_S = 0.25  # how long one Health probe waits before the next is sent

ConnState = Literal["up", "down", "refused"]
UP: ConnState = "up"            # registered
DOWN: ConnState = "down"        # the server does not answer: registering again the moment it does
REFUSED: ConnState = "refused"  # the server answered and refused the registration: tried again after retry_s


class Refused(Exception):
    """The server answered a registration with a refusal: the next try waits `retry_s`."""


class WorkerHealth(KVConnectorWorkerMetadata):
    """Each worker rank's connection state, sent when it changed (vLLM merges the ranks' with `aggregate`)."""

    def __init__(self, states: dict[int, ConnState]):
        self.states = dict(states)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, WorkerHealth):
            return WorkerHealth({**self.states, **other.states})
        return self


def wait_answering(endpoint: str, stop: threading.Event, answered: threading.Event,
                   probe_s: float = PROBE_S) -> bool:
    """Block until the server at `endpoint` answers a Health (True, `answered` set at once: the probe's connection
    closes after it) or `stop` is set (False)."""
    with CacheClient(endpoint, timeout_s=probe_s) as client:
        while not stop.is_set():
            try:
                client.call(P.Health(), timeout=probe_s)
                answered.set()
                return True
            except Exception:
                stop.wait(0.01)  # a probe that failed at once (a full send queue) must not spin
    return False


T = TypeVar("T")


class Reconnector(Generic[T]):
    """Runs `connect` on a thread of its own once the server answers a probe; `connect` raises `Refused` when the
    server refused (the next try then waits `retry_s`), anything else when it stopped answering again (probe
    again). `start()` returns the attempt in flight, or starts a new one."""

    def __init__(self, endpoint: str, connect: Callable[[], T], retry_s: float, name: str):
        self.endpoint = endpoint
        self._connect = connect
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._future: Future[T] | None = None
        self.refused = False  # the last registration was refused: waiting retry_s
        self.answered = threading.Event()  # the attempt in flight heard the server: its registration is under way

    def start(self) -> Future[T]:
        with self._lock:
            if self._stop.is_set():  # closed: no new attempt (a connection dropped while shutting down)
                closed: Future[T] = Future()
                closed.set_exception(ConnectionError("the connector is closing"))
                return closed
            if self._future is None or self._future.done():
                self.answered.clear()
                self._future = self._pool.submit(self._run)
            return self._future

    def _run(self) -> T:
        while True:
            if not wait_answering(self.endpoint, self._stop, self.answered):
                raise ConnectionError("the connector is closing")
            try:
                out = self._connect()
            except Refused as e:
                self.refused = True
                self.answered.clear()
                log.warning("hybridkv: cache server %s refused the registration (%s); trying again in %.0f s",
                            self.endpoint, e, self._retry_s)
                if self._stop.wait(self._retry_s):
                    raise ConnectionError("the connector is closing") from None
                continue
            except Exception as e:  # it stopped answering again: probe again
                self.answered.clear()
                log.info("hybridkv: registration with %s failed (%s); probing again", self.endpoint, e)
                continue
            self.refused = False
            return out

    def close(self) -> None:
        with self._lock:
            self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
