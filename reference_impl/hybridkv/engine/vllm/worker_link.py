"""A worker rank's connection to the cache server: its registration, the reconnect the moment a server that failed
answers again, and the state it reports to the scheduler side.

A connection that failed is not left alone for a fixed time: a thread of its own probes the server and registers
again the moment it answers (`health.Reconnector`); loads planned meanwhile wait for that (`worker_loads`). Each rank
reports its connection's state to the scheduler side (`health.WorkerHealth`), which offers no hit while a rank's
registration is refused. When the scheduler side registered again (`HybridKVMetadata.server_epoch`: the server
restarted, or it came back), the step checks this rank's registration first (one Heartbeat) and waits for its new
one if the server forgot it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridkv.engine.client import ServerError
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.engine.vllm.health import DOWN, REFUSED, UP, ConnState, Reconnector, Refused, WorkerHealth
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.model.layout import LayoutError, ModelLayout
from hybridkv.wire import protocol as P
from hybridkv.wire.protocol import ErrorCode

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class WorkerLink:
    """One rank's connection (`transfer`, None while there is none). When a connection is dropped, `forget()`
    (under the link's lock, with `transfer` None) forgets what was in flight on it, and `close(t)` closes it."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_rank: int,
                 forget: Callable[[], None], close: Callable[[KVTransfer], None]):
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_rank = tp_rank
        self.transfer: KVTransfer | None = None
        self.pages: list[list[torch.Tensor]] | None = None
        self._forget, self._close = forget, close
        self._lock = threading.Lock()  # self.transfer, set by the reconnect thread too
        self._reconnector = Reconnector(settings.endpoint, self._register, settings.retry_s, "hkv-vllm-connect")
        self._epoch = 0  # the scheduler side's registration this rank last checked its own against
        self._reported: ConnState = UP  # the state the scheduler side last heard (it assumes UP at start)

    @property
    def refused(self) -> bool:
        """The server answers but refused this rank's registration (it is tried again after `retry_s`)."""
        return self._reconnector.refused

    def connect(self, at_start: bool = False) -> KVTransfer | None:
        """The connection; None when there is none yet (a reconnect is started, off the step). At start-up the
        registration is made here, and a layout the server refuses is an error."""
        if (t := self.transfer) is not None:
            return t
        if at_start and self.pages is not None:
            try:
                t = self._new_transfer(self.settings.timeout_s)
            except (ServerError, LayoutError) as e:
                if isinstance(e, LayoutError) or e.code == ErrorCode.LAYOUT:
                    raise LayoutError(f"cache server {self.settings.endpoint} refused vLLM's layout: {e}") from None
                self._unreachable(e)
            except Exception as e:  # timeout, connection refused: the server is down
                self._unreachable(e)
            else:
                with self._lock:
                    self.transfer = t
                return t
        self.connect_soon()
        return None

    def _new_transfer(self, timeout_s: float) -> KVTransfer:
        s = self.settings
        assert self.pages is not None
        # the settings' transfer axes as they are (their policies are vLLM's one, boundary: ConnectorSettings checks)
        cfg = TransferConfig(**s.axes(), chunk_tokens=self.chunk_tokens, tp_rank=self.tp_rank, salt=s.salt,
                             timeout_s=timeout_s, name=f"vllm-rank{self.tp_rank}",
                             max_link_fraction=s.max_link_fraction, max_compute_cost=s.max_compute_cost,
                             link_gbps=s.link_gbps)
        t = KVTransfer(s.endpoint, self.layout, self.pages, cfg)
        t.client.timeout_s = s.timeout_s
        return t

    def _register(self) -> KVTransfer:
        """The reconnect thread's registration, once the server answered a probe."""
        try:
            t = self._new_transfer(self.settings.lookup_timeout_s)
        except (ServerError, LayoutError) as e:  # e.g. restarted with another --chunk-tokens: misses, logged
            raise Refused(str(e)) from e
        with self._lock:
            self.transfer = t
        log.info("hybridkv: rank %d registered with cache server %s again", self.tp_rank, self.settings.endpoint)
        return t

    def connect_soon(self) -> None:
        """Reconnect on a thread of its own once the server answers (Register may wait for a hung server), never
        in vLLM's step."""
        if self.transfer is None and self.pages is not None:
            self._reconnector.start()

    def wait_registered(self, timeout_s: float) -> None:
        """Start a reconnect if none is under way and wait at most `timeout_s` for it (errors: still down)."""
        try:
            self._reconnector.start().result(timeout=timeout_s)
        except Exception:
            pass  # still down: this step's loads wait for it, its stores are dropped

    def _unreachable(self, e: BaseException) -> None:
        log.warning("hybridkv: cache server %s unreachable from rank %d (%s); registering again as soon as it "
                    "answers", self.settings.endpoint, self.tp_rank, e)

    def health(self) -> ConnState:
        """This rank's connection: registered, waiting for the server to answer, or refused by it."""
        return UP if self.transfer is not None else REFUSED if self._reconnector.refused else DOWN

    def health_report(self) -> WorkerHealth | None:
        """This rank's state for the scheduler side, when it changed since the last report."""
        state = self.health()
        if state == self._reported:
            return None
        self._reported = state
        return WorkerHealth({self.tp_rank: state})

    def follow_scheduler(self, epoch: int) -> None:
        """The scheduler side registered again since the last step (the server restarted or came back): it has
        just heard the server, so check this rank's registration now (one Heartbeat), and where the server no
        longer knows it, wait for the new one (a round trip; `lookup_timeout_s` at most) before this step's
        loads and stores use it."""
        if epoch == self._epoch:
            return
        self._epoch = epoch
        if (t := self.transfer) is not None:
            try:
                t.client.call(P.Heartbeat(engine=t.engine_id), timeout=self.settings.lookup_timeout_s)
                return
            except Exception as e:
                self.drop(t, e)
        if self.pages is not None:
            self.wait_registered(self.settings.lookup_timeout_s)

    def drop(self, t: KVTransfer, e: BaseException) -> None:
        """Forget a connection that failed and close it, then register again once the server answers."""
        with self._lock:
            if self.transfer is not t:
                return
            self.transfer = None
            self._forget()
        self._unreachable(e)
        self._close(t)
        self.connect_soon()

    def close(self) -> None:
        self._reconnector.close()
