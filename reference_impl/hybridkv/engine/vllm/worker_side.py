"""The connector's worker half: `hybridkv.engine.transfer.KVTransfer` moves the bytes, the same code the
CUDA suite covers on the GPU machine.

Nothing here makes vLLM's step wait on the cache server longer than `lookup_timeout_s` / `step_timeout_s`:
- Loads are asynchronous (vLLM's `load_kv_async`): `start_load` starts each load's copies from the objects the
  scheduler side's lookup pinned (`plan.PinnedHit`: no lookup of the worker's own, where the pins lie in the
  arena this rank maps), or else after a pinning lookup of its own (at most `lookup_timeout_s`; a server that
  does not answer is dropped, so only the first request that meets it waits); the copies end on their own (on
  a CPU they run in `start_load`, so the same step reports the load); the request waits in vLLM's queue
  (WAITING_FOR_REMOTE_KVS) holding its blocks until `transfer_results` reports it. A load that failed, or
  whose copies had not started `lookup_timeout_s` later (a payload wire's answer stuck), is reported as a
  failed receive, which vLLM recomputes; a load given up before its first page write never writes.
  Because the load ends before the request is scheduled, the GDN state written into block `(h-1)//B` is
  there when vLLM's mamba preprocessing copies it into the request's running block.
- Copies start after the work the engine queued on its current stream before `start_load` (vLLM zeroes
  new blocks there).
- A store's reservation is asked for before the forward (`prepare_store` with vLLM's block ids). On CUDA,
  when its answer is in by `save`, the copies are queued and vLLM's stream is made to wait for them on the
  GPU: the step does not wait, and nothing vLLM queues later reads or writes the blocks first. Otherwise
  (a CPU engine, a late answer, a payload wire) the copy is awaited in `save` for at most `step_timeout_s`;
  one not done by then is cancelled and never commits.
- A connection that failed is not left alone for a fixed time: a thread of its own probes the server and
  registers again the moment it answers (`health.Reconnector`); a load planned meanwhile waits for that
  (`lookup_timeout_s` at most) instead of failing. Each rank reports its connection's state to the scheduler
  side (`health.WorkerHealth`), which offers no hit while a rank's registration is refused. When the scheduler
  side registered again (`HybridKVMetadata.server_epoch`: the server restarted, or it came back), the step
  checks this rank's registration first (one Heartbeat) and waits for its new one if the server forgot it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv import protocol as P
from hybridkv.engine.client import ServerError
from hybridkv.engine.handles import Hit
from hybridkv.engine.paged import engine_pages
from hybridkv.engine.transfer import KVTransfer, PreparedStore, TransferConfig, TransferHandle
from hybridkv.engine.vllm.events import StoreReports
from hybridkv.engine.vllm.health import DOWN, REFUSED, UP, ConnState, Reconnector, Refused, WorkerHealth
from hybridkv.engine.vllm.layerwise import LayerwiseLoads, tp_vote
from hybridkv.engine.vllm.plan import HybridKVMetadata, LoadJob, LoadRefused
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.engine.vllm.stats import WorkerStats
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.protocol import ErrorCode
from hybridkv.wire_formats import traits

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Load:
    """One request's asynchronous load, from `start_load` until `transfer_results` reports it."""

    job: LoadJob
    deadline: float  # its copies must have started by then, or the load is given up
    handle: TransferHandle | None = None  # None: it failed before any copy (`error`), or it is `waiting`
    error: BaseException | None = None
    waiting: bool = False  # for this rank's registration (the server answered again): started once it is in
    ready: torch.cuda.Event | None = None  # after the engine's work queued before the load was asked for
    again: bool = False  # it waited for a registration once already (the server had forgotten this rank)


@dataclass(slots=True)
class _Ending:
    """Stores of a finished request whose commits are still in flight: its session ends after them."""

    handles: list[TransferHandle] = field(default_factory=list)


class WorkerSide:
    """One vLLM worker rank's transfers."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_rank: int,
                 events: bool = False, tp_size: int = 1):
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_rank = tp_rank
        self.stats = WorkerStats()
        self.transfer: KVTransfer | None = None
        self._pages: list[list[torch.Tensor]] | None = None
        self._lock = threading.Lock()  # self.transfer, set by the reconnect thread too
        self._reconnector = Reconnector(settings.endpoint, self._register, settings.retry_s, "hkv-vllm-connect")
        self._epoch = 0  # the scheduler side's registration this rank last checked its own against
        self._reported: ConnState = UP  # the state the scheduler side last heard (it assumes UP at start)
        self._loads: dict[str, _Load] = {}
        self._in_flight: dict[str, list[TransferHandle]] = {}
        self._ending: dict[str, _Ending] = {}
        self._prepared: dict[tuple[str, int], PreparedStore] = {}  # (request, start chunk) -> this step's prepare
        # vLLM publishes KV events: how each store ended, for the scheduler side's (`hybridkv.engine.vllm.events`)
        self.events = StoreReports(tp_rank, chunk_tokens) if events else None
        self.layerwise = LayerwiseLoads(layout, self.stats, settings.timeout_s, tp_vote(tp_size)) \
            if settings.load_mode == "layerwise" else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Page views of vLLM's cache tensors, checked against the layout, then the server connection (at
        start-up a layout the server refuses is an error; later it is a miss)."""
        self._pages = engine_pages(self.layout, kv_caches)
        self._connect(at_start=True)

    # ---- the server connection (the loader thread's, after start-up) ------------------------------

    def _connect(self, at_start: bool = False) -> KVTransfer | None:
        """The connection; None when there is none yet (a reconnect is started, off the step). At start-up the
        registration is made here, and a layout the server refuses is an error."""
        if (t := self.transfer) is not None:
            return t
        if at_start and self._pages is not None:
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
        self._connect_soon()
        return None

    def _new_transfer(self, timeout_s: float) -> KVTransfer:
        s = self.settings
        assert self._pages is not None
        # the settings' transfer axes as they are (their policies are vLLM's one, boundary: ConnectorSettings checks)
        cfg = TransferConfig(**s.axes(), chunk_tokens=self.chunk_tokens, tp_rank=self.tp_rank, salt=s.salt,
                             timeout_s=timeout_s, name=f"vllm-rank{self.tp_rank}")
        t = KVTransfer(s.endpoint, self.layout, self._pages, cfg)
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

    def _connect_soon(self) -> None:
        """Reconnect on a thread of its own once the server answers (Register may wait for a hung server), never
        in vLLM's step."""
        if self.transfer is None and self._pages is not None:
            self._reconnector.start()

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

    def _follow_scheduler(self, epoch: int) -> None:
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
                self._drop(t, e)
        if self._pages is None:
            return
        try:
            self._reconnector.start().result(timeout=self.settings.lookup_timeout_s)
        except Exception:
            pass  # still down: this step's loads wait for it, its stores are dropped

    def _drop(self, t: KVTransfer, e: BaseException) -> None:
        """Forget a connection that failed; it is closed on a thread of its own (close waits for its work)."""
        with self._lock:
            if self.transfer is not t:
                return
            self.transfer = None
            self._in_flight.clear()
            self._ending.clear()
            self._prepared.clear()
        self._unreachable(e)
        if self.layerwise is None or not self.layerwise.close_when_unheld(t):  # held hits copy from its arena
            threading.Thread(target=t.close, name="hkv-vllm-close", daemon=True).start()
        self._connect_soon()

    # ---- loads: asynchronous, before the request is scheduled ------------------------------------

    def start_load(self, meta: HybridKVMetadata) -> None:
        """Reserve this step's stores (their round trips overlap the forward), then start every planned load:
        the pinning lookup (at most `lookup_timeout_s`), then copies ordered after the work already queued on
        the engine's current stream, which end on their own (CUDA streams, or the transfer's load thread).
        `transfer_results` reports them; nothing here waits for a copy. load_mode layerwise: first the attention
        copies of the requests vLLM promoted this step (`layerwise`), which this step's forward reads."""
        self._follow_scheduler(meta.server_epoch)
        self.start_step_loads(meta)
        self._prepare_stores(meta)
        if not meta.loads:
            return
        ready = self._ready_event()
        for job in meta.loads:
            load = _Load(job, 0.0)
            self._loads[job.request_id] = load
            if self.transfer is None and not job.refused and not self._reconnector.refused:
                self._wait_for_registration(load, ready)
                continue
            self._begin(load, ready)

    def _wait_for_registration(self, load: _Load, ready: torch.cuda.Event | None) -> None:
        """The scheduler heard the server (it offered this hit): this rank registers again within a round trip of
        the server's answer; the load starts then (`transfer_results`), or fails `lookup_timeout_s` from now."""
        self._connect_soon()
        load.waiting, load.ready = True, ready
        load.deadline = time.monotonic() + self.settings.lookup_timeout_s

    def _begin(self, load: _Load, ready: torch.cuda.Event | None) -> None:
        """Start a load: its pinning lookup, then its copies (`_start_load`)."""
        job = load.job
        t0 = time.perf_counter()
        try:
            load.handle = self._start_load(job, ready)
        except Exception as e:
            if isinstance(e, ServerError) and e.code == ErrorCode.UNKNOWN_ENGINE and not load.again:
                # the server restarted (or reclaimed this rank) and answered: the registration is a round trip away
                load.again = True
                self._wait_for_registration(load, ready)
                self.stats.load_s += time.perf_counter() - t0
                return
            load.error = e
        self.stats.load_s += time.perf_counter() - t0
        # a direct wire's copies read the mapped arena, never the server: they end on their own however
        # busy the engine is, and giving them up would only cost a recompute. A payload wire's copies wait
        # for the server's frames first: those are given up if they have not started in time.
        t = self.transfer
        direct = t is not None and traits(t.config.wire_format).direct
        load.deadline = float("inf") if direct else time.monotonic() + self.settings.lookup_timeout_s

    def start_step_loads(self, meta: HybridKVMetadata) -> None:
        """load_mode layerwise: this step's attention copies, once, before the first attention layer reads."""
        if self.layerwise is not None and meta.step_loads and not self.layerwise.started:
            self.layerwise.start(meta.step_loads, self._ready_event())

    def _ready_event(self) -> torch.cuda.Event | None:
        """An event after the engine's queued work (CUDA), or None (CPU: that work is done already)."""
        if (stream := self._engine_stream()) is None:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _start_load(self, job: LoadJob, ready: torch.cuda.Event | None) -> TransferHandle:
        """Start copying the hit into the blocks the scheduler side named (`plan.load_block_ids`: the ones vLLM
        expects from the connector), from the objects the scheduler's lookup pinned or else after pinning them
        under this rank's engine; a load it refused fails here. On a CPU the copies run here (`inline`): on a
        thread of their own, beside an engine loop that never sleeps (vLLM in-process), each of their torch
        calls could wait the interpreter's switch interval for the GIL."""
        if job.refused:
            raise LoadRefused(job.refused)
        t = self.transfer
        if t is None:
            self._connect_soon()
            raise ConnectionError("no connection to the cache server")
        hit = self._pinned(t, job)
        if hit is None:
            try:
                hit = t.lookup(job.request_id, job.token_ids, skip_tokens=job.skip_tokens,
                               timeout=self.settings.lookup_timeout_s, extras=job.extras)
            except (TimeoutError, ConnectionError, ServerError) as e:
                if not isinstance(e, ServerError) or e.code == ErrorCode.UNKNOWN_ENGINE:
                    self._drop(t, e)  # the server is gone, hung or forgot us: reconnect once it answers, off the step
                raise
            if hit.hit_tokens < len(job.token_ids):
                t.end_session_soon(job.request_id)
                raise LookupError(f"the server holds {hit.hit_tokens} of the {len(job.token_ids)} hit tokens now")
        # load_mode layerwise: the GDN states now, the attention part held (pinned) for the request's first step
        return t.retrieve(hit if self.layerwise is None else self.layerwise.hold(t, hit, job), job.block_ids, ready,
                          inline=True)

    def _pinned(self, t: KVTransfer, job: LoadJob) -> Hit | None:
        """This rank's part of the scheduler's lookup, pinned under the scheduler's leases until the request ends
        (lease 0: the load releases nothing). None where this rank must look the hit up itself: none was handed
        down, a payload wire (the server sends the bytes of a lease of this rank's own engine), or the pins lie
        in another arena than the one this rank maps (the server restarted in between: those offsets would
        read other bytes)."""
        p = job.pinned
        if p is None or self.tp_rank >= len(p.objects) or p.arena != t.arena_path \
                or not traits(t.config.wire_format).direct:
            return None
        self.stats.loads_pinned += 1
        return Hit(job.request_id, [], len(job.token_ids) // self.chunk_tokens, self.chunk_tokens, 0,
                   p.objects[self.tp_rank])

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) loads since the last call; a failed one is also finished (vLLM's contract). A
        load whose lookup is overdue is given up here, so a hung server costs a recompute, not a wait."""
        finished: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for load in self._loads.values():
            if load.waiting and (self.transfer is not None or now > load.deadline):
                load.waiting = False
                if self.transfer is not None:
                    self._begin(load, load.ready)
                else:
                    load.error = ConnectionError(f"no connection to the cache server within "
                                                 f"{self.settings.lookup_timeout_s:g} s")
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            if load.waiting:
                continue
            h = load.handle
            if h is None or h.done.done():
                if h is not None and h.done.exception() is None:
                    self.stats.loads += 1
                    self.stats.loaded_bytes += h.nbytes
                else:
                    failed.add(rid)
                    self.stats.load_failures += 1
                    log.warning("hybridkv: load of %s failed (%s); vLLM recomputes it", rid,
                                load.error if h is None else h.done.exception())
            elif now > load.deadline and h.cancel():
                failed.add(rid)
                self.stats.load_failures += 1
                self.stats.loads_given_up += 1
                log.warning("hybridkv: load of %s given up: its copies had not started %.2g s after it was asked "
                            "for; vLLM recomputes it", rid, self.settings.lookup_timeout_s)
            else:
                continue
            del self._loads[rid]
            finished.add(rid)
        return finished, failed

    # ---- stores: prepared before the forward, copied after it ------------------------------------

    def _prepare_stores(self, meta: HybridKVMetadata) -> None:
        """Send each planned store's prepare now; a store whose prepare failed here prepares itself later."""
        self._prepared.clear()  # an earlier step's leftovers: end_session aborts them on the server
        t = self.transfer
        if not meta.stores or t is None:
            return
        for job in meta.stores:
            try:
                self._prepared[job.request_id, job.start_chunk] = t.prepare_store(
                    job.request_id, job.token_ids, job.start_chunk, block_ids=job.block_ids, extras=job.extras)
            except Exception as e:
                log.warning("hybridkv: prepare of the store of %s failed (%s); the store prepares itself",
                            job.request_id, e)

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy every planned store out of vLLM's blocks; commits finish in the background. On CUDA, a store
        whose copies are queued when it is asked for (its reservation came back during the forward) costs the
        step nothing: vLLM's stream is made to wait for the copies on the GPU, so nothing vLLM queues later
        (zeroing a reused block, the next forward) runs before the pages are read. Any other store is waited
        for here, at most `step_timeout_s` for the step; one not copied in time is cancelled: it never
        commits."""
        if self.layerwise is not None:  # this step's in-step loads end before anything later reads their blocks
            self.layerwise.end_step(self._engine_stream())
        if not meta.stores:
            return
        t = self.transfer
        if t is None:
            for job in meta.stores:
                if self.events is not None:
                    self.events.report(job, False)
            self._connect_soon()
            return
        t0 = time.perf_counter()
        until = time.monotonic() + self.settings.step_timeout_s
        handles = []
        cancelled = 0
        forgotten: BaseException | None = None  # the server answered that it does not know this engine
        for job in meta.stores:
            try:
                h = t.store(job.request_id, job.token_ids, job.block_ids, start_chunk=job.start_chunk,
                            prepared=self._prepared.pop((job.request_id, job.start_chunk), None), extras=job.extras)
            except Exception as e:
                self.stats.store_failures += 1
                if self.events is not None:
                    self.events.report(job, False)
                log.warning("hybridkv: store of %s failed (%s); a later request misses it", job.request_id, e)
                forgotten = e if _unknown_engine(e) else forgotten
                continue
            handles.append(h)
            if self.events is not None:
                h.committed.add_done_callback(functools.partial(self.events.report_commit, job, h))
        stream = self._engine_stream()
        for h in handles:
            if stream is not None and h.order_after_copies(stream):
                self.stats.stores_ordered += 1
                h.committed.add_done_callback(functools.partial(self._counted, h))
                self._in_flight.setdefault(h.request_id, []).append(h)
                continue
            try:
                h.wait(max(0.0, until - time.monotonic()))  # pages read: vLLM may reuse the blocks
            except TimeoutError:
                if h.cancel():
                    cancelled += 1
                    continue
                h.wait(self.settings.timeout_s)  # read already, committing: the copies end on their own
            except Exception as e:
                self.stats.store_failures += 1
                log.warning("hybridkv: store of %s failed (%s); a later request misses it", h.request_id, e)
                forgotten = e if _unknown_engine(e) else forgotten
                continue
            self._count_store(h)
            self._in_flight.setdefault(h.request_id, []).append(h)
        self.stats.store_s += time.perf_counter() - t0
        if forgotten is not None:
            # a load reads the scheduler's pins and needs no registration of this rank, so a store is where a
            # restarted or reclaiming server shows it forgot us: register again once it answers
            self._drop(t, forgotten)
        elif cancelled:
            # a hung server (or one whose answers stopped): no more stores until a reconnect, or every step
            # would wait step_timeout_s again
            self.stats.stores_cancelled += cancelled
            self._drop(t, TimeoutError(f"{cancelled} stores not copied in {self.settings.step_timeout_s:g} s; "
                                       "cancelled, never committed"))

    def _engine_stream(self):
        """vLLM's current CUDA stream (its forward's), or None on a CPU engine (copies there run on threads:
        only waiting orders them before vLLM's next writes)."""
        if self._pages is None or self._pages[0][0].device.type != "cuda":
            return None
        import torch

        return torch.cuda.current_stream(self._pages[0][0].device)

    def take_store_reports(self) -> list[tuple[int, str, int, int, bool]]:
        """(rank, request, first chunk, end chunk, held in full) of every store that ended since the last call."""
        return self.events.take() if self.events is not None else []

    def _counted(self, h: TransferHandle, _: Future) -> None:
        self._count_store(h)

    def _count_store(self, h: TransferHandle) -> None:
        """A store whose pages were read (a failed commit is counted when its request ends)."""
        if h.committed.done() and h.committed.exception() is not None:
            return
        self.stats.stores += 1
        self.stats.stored_bytes += h.nbytes

    def request_finished(self, finished: set[str]) -> None:
        """End the server sessions of finished requests once their commits are in (without waiting)."""
        if self.layerwise is not None:
            self.layerwise.finished(finished)
        for rid in finished:
            self._ending.setdefault(rid, _Ending()).handles.extend(self._in_flight.pop(rid, []))
        t = self.transfer
        for rid in [r for r, e in self._ending.items() if all(h.committed.done() for h in e.handles)]:
            ending = self._ending.pop(rid)
            self.stats.store_failures += sum(1 for h in ending.handles if h.committed.exception() is not None)
            if t is not None:
                try:
                    t.end_session_soon(rid)
                except Exception as e:
                    self._drop(t, e)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait for every load and in-flight commit, then end the sessions of finished requests whose commits
        were all that kept them open (the harness, tests and shutdown): after this the server holds none of
        their pins."""
        until = time.monotonic() + timeout_s
        for load in list(self._loads.values()):
            if load.handle is not None:
                try:
                    load.handle.wait(max(0.0, until - time.monotonic()))
                except Exception:
                    pass  # reported by transfer_results
        for hs in [*self._in_flight.values(), *(e.handles for e in self._ending.values())]:
            for h in hs:
                try:
                    h.wait_committed(max(0.0, until - time.monotonic()))
                except Exception:
                    pass  # counted when its request ends
        self.request_finished(set())
        if (t := self.transfer) is not None:
            try:
                t.client.call(P.Health(), timeout=max(0.1, until - time.monotonic()))
            except Exception:
                pass

    def close(self) -> None:
        self._reconnector.close()
        if self.transfer is not None:
            self.wait_idle(self.settings.timeout_s)
            self.transfer.close()
            self.transfer = None


def _unknown_engine(e: BaseException) -> bool:
    """The server's answer that it does not know the engine (it restarted, or reclaimed it)."""
    return isinstance(e, ServerError) and e.code == ErrorCode.UNKNOWN_ENGINE
