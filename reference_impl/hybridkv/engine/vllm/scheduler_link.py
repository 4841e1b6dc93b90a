"""The scheduler side's connection to the cache server: one registration per tensor-parallel rank, all in one round
trip; a reconnect the moment a server that failed answers again (`health.Reconnector`); a new registration at once
where a server answers `unknown_engine` (it restarted); and the worker ranks' connection states, so that no hit is
offered a rank cannot load (`health.WorkerHealth`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.engine.vllm.health import REFUSED, ConnState, Reconnector, Refused
from hybridkv.engine.vllm.settings import ConnectorSettings, no_server_at_start
from hybridkv.model.layout import LayoutError, ModelLayout
from hybridkv.wire import protocol as P

log = logging.getLogger(__name__)


class SchedulerLink:
    """The scheduler's registrations (`ranks`: each rank's engine and namespace, rank 0 first) on one connection
    (`client`, None while there is none)."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_size: int = 1):
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.client: CacheClient | None = None
        self.ranks: list[tuple[int, bytes]] = []  # (engine, namespace) of each rank, rank 0 first
        self.l2 = False  # the server has an L2: only then can a prefix have to come back from disk
        self.server_epoch = 0  # registrations since the first: the workers check theirs when it moves
        self._workers: dict[int, ConnState] = {}  # each worker rank's connection, as it last reported it
        self.arena = ""  # the server's arena file: where the objects a lookup pins lie, for the workers
        self._reconnector = Reconnector(settings.endpoint, self._reregister, settings.retry_s,
                                        "hkv-vllm-sched-connect")
        self._reconnecting: Future | None = None  # its attempt in flight, or done and not taken yet
        self.connect(at_start=True)

    def _register(self) -> tuple[CacheClient, list[P.Registered]]:
        """A Register per rank on a new connection, all in flight at once, awaited (`lookup_timeout_s`)."""
        client = CacheClient(self.settings.endpoint, timeout_s=self.settings.lookup_timeout_s)
        try:
            futs = [client.submit(P.Register(layout=self.layout, chunk_tokens=self.chunk_tokens, tp_rank=rank,
                                             salt=self.settings.salt, name=f"vllm-scheduler-rank{rank}"))
                    for rank in range(self.tp_size)]
            regs = [f.result(timeout=self.settings.lookup_timeout_s + 5)[0] for f in futs]
            expect = [self.layout.object_bytes(g, self.chunk_tokens) for g in range(len(self.layout.groups))]
            for reg in regs:
                if reg.object_bytes != expect:
                    raise LayoutError(f"cache server sizes objects {reg.object_bytes}, vLLM's layout {expect}")
        except BaseException:
            client.close()
            raise
        return client, regs

    def _reregister(self) -> tuple[CacheClient, list[P.Registered]]:
        """The reconnect thread's registration, once the server answered a probe (a refusal waits `retry_s`)."""
        try:
            return self._register()
        except (ServerError, LayoutError) as e:  # e.g. restarted with another chunk size: a logged miss
            raise Refused(str(e)) from e

    def connect(self, at_start: bool = False, now: bool = False) -> bool:
        """True when registered. Otherwise False (a miss for now), with a reconnect under way that registers the
        moment the server answers; once that is in, it is taken here. At start-up (and with `now`: the server
        has just answered) the registration is made on this thread; at start-up a layout the server refuses is
        a LayoutError."""
        if self.client is not None:
            return True
        if at_start or now:
            try:
                client, regs = self._register()
            except (ServerError, LayoutError) as e:
                if at_start and (isinstance(e, LayoutError) or e.code == P.ErrorCode.LAYOUT):
                    raise LayoutError(f"cache server {self.settings.endpoint} refused vLLM's layout: {e}") from None
                return self._unreachable(e)
            except Exception as e:  # timeout, bad endpoint: the server is down
                if at_start:
                    log.error(no_server_at_start(self.settings, e))
                return self._unreachable(e)
        else:
            fut = self._reconnect_soon()
            if not fut.done() and self._reconnector.answered.is_set():
                wait_futures([fut], timeout=self.settings.lookup_timeout_s)  # registering: one round trip away
            if not fut.done():
                return False
            self._reconnecting = None
            if fut.exception() is not None:
                return False
            client, regs = fut.result()
        for reg in regs:
            client.keepalive(reg.engine, reg.heartbeat_s)
        again = bool(self.ranks)
        self.client, self.l2, self.arena = client, regs[0].l2, regs[0].arena_path
        self.ranks = [(reg.engine, reg.namespace) for reg in regs]
        if again:
            self.server_epoch += 1
            log.info("hybridkv: registered with cache server %s again", self.settings.endpoint)
        return True

    def _unreachable(self, e: BaseException) -> bool:
        log.warning("hybridkv: cache server %s unreachable (%s); no external hits until it answers",
                    self.settings.endpoint, e)
        self._reconnect_soon()
        return False

    def _reconnect_soon(self) -> Future:
        """The reconnect attempt (registering the moment the server answers), started if none is under way."""
        if self._reconnecting is None:
            self._reconnecting = self._reconnector.start()
        return self._reconnecting

    def drop(self, e: BaseException, reconnect: bool = True) -> None:
        if self.client is not None:
            self.client.close()
        self.client = None
        if reconnect:
            self._unreachable(e)

    def worker_health(self, states: dict[int, ConnState]) -> None:
        """Worker ranks' connection states that changed (`health.WorkerHealth`, from the step's outputs)."""
        self._workers.update(states)

    def workers_can_load(self) -> bool:
        """No rank reports a registration the server refused: a hit offered now would fail its load there. (A
        rank that is only reconnecting registers again as soon as the server answers the scheduler's lookup, and
        its load waits for that.)"""
        return REFUSED not in self._workers.values()

    def ask_ranks(self, msgs: list, timeout: float) -> list:
        """One request per rank, all in flight at once (one round trip whatever the TP size), and their
        replies in rank order within `timeout`. Rank 0's is answered on this thread (`call`, no hand-off from
        the client's I/O thread: the single-rank case stays one plain call); the others are sent first."""
        assert self.client is not None
        until = time.monotonic() + timeout
        others = [self.client.submit(m) for m in msgs[1:]]
        first, _ = self.client.call(msgs[0], timeout=timeout)
        return [first, *(f.result(timeout=max(0.0, until - time.monotonic()))[0] for f in others)]

    def close(self) -> None:
        self._reconnector.close()
        if self.client is not None:
            try:
                for engine, _ in self.ranks:
                    self.client.forget(engine)
                    self.client.call(P.Unregister(engine=engine), timeout=2)
            except Exception:
                pass  # the server reclaims silent engines anyway
            self.client.close()
            self.client = None
