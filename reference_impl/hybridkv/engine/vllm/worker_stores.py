"""A worker rank's stores: reserved before the forward, copied out of vLLM's blocks after it, committed in the
background; a finished request's session ends once its commits are in.

A store's reservation is asked for before the forward (`prepare` with vLLM's block ids). On CUDA, when its answer is
in by `save`, the copies are queued and vLLM's stream is made to wait for them on the GPU: the step does not wait,
and nothing vLLM queues later reads or writes the blocks first. Otherwise (a CPU engine, a late answer, a payload
wire) the copy is awaited in `save` for at most `step_timeout_s`; one not done by then is cancelled and never
commits.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.engine.client import ServerError
from hybridkv.engine.transfer import PreparedStore, TransferHandle
from hybridkv.engine.vllm.events import StoreReports
from hybridkv.engine.vllm.plan import StoreJob
from hybridkv.engine.vllm.stats import WorkerStats
from hybridkv.engine.vllm.worker_link import WorkerLink
from hybridkv.wire.protocol import ErrorCode

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Ending:
    """Stores of a finished request whose commits are still in flight: its session ends after them."""

    handles: list[TransferHandle] = field(default_factory=list)


class WorkerStores:
    """The stores of one rank, from their prepare to the end of their request's session."""

    def __init__(self, link: WorkerLink, stats: WorkerStats, events: StoreReports | None):
        self.link = link
        self.settings = link.settings
        self.stats = stats
        self.events = events  # vLLM publishes KV events: how each store ended, for the scheduler side's
        self._in_flight: dict[str, list[TransferHandle]] = {}
        self._ending: dict[str, _Ending] = {}
        self._prepared: dict[tuple[str, int], PreparedStore] = {}  # (request, start chunk) -> this step's prepare

    def forget(self) -> None:
        """The connection was dropped: nothing in flight on it will be heard of."""
        self._in_flight.clear()
        self._ending.clear()
        self._prepared.clear()

    def prepare(self, jobs: list[StoreJob]) -> None:
        """Send each planned store's prepare now; a store whose prepare failed here prepares itself later."""
        self._prepared.clear()  # an earlier step's leftovers: end_session aborts them on the server
        t = self.link.transfer
        if not jobs or t is None:
            return
        for job in jobs:
            try:
                self._prepared[job.request_id, job.start_chunk] = t.prepare_store(
                    job.request_id, job.token_ids, job.start_chunk, block_ids=job.block_ids, extras=job.extras)
            except Exception as e:
                log.warning("hybridkv: prepare of the store of %s failed (%s); the store prepares itself",
                            job.request_id, e)

    def save(self, jobs: list[StoreJob], stream: torch.cuda.Stream | None) -> None:
        """Copy every planned store out of vLLM's blocks; commits finish in the background. On CUDA (`stream`:
        vLLM's), a store whose copies are queued when it is asked for (its reservation came back during the
        forward) costs the step nothing: vLLM's stream is made to wait for the copies on the GPU, so nothing vLLM
        queues later (zeroing a reused block, the next forward) runs before the pages are read. Any other store
        is waited for here, at most `step_timeout_s` for the step; one not copied in time is cancelled: it never
        commits."""
        if not jobs:
            return
        t = self.link.transfer
        if t is None:
            for job in jobs:
                if self.events is not None:
                    self.events.report(job, False)
            self.link.connect_soon()
            return
        t0 = time.perf_counter()
        until = time.monotonic() + self.settings.step_timeout_s
        handles = []
        cancelled = 0
        forgotten: BaseException | None = None  # the server answered that it does not know this engine
        for job in jobs:
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
            self.link.drop(t, forgotten)
        elif cancelled:
            # a hung server (or one whose answers stopped): no more stores until a reconnect, or every step
            # would wait step_timeout_s again
            self.stats.stores_cancelled += cancelled
            self.link.drop(t, TimeoutError(f"{cancelled} stores not copied in {self.settings.step_timeout_s:g} s; "
                                           "cancelled, never committed"))

    def take_reports(self) -> list[tuple[int, str, int, int, bool]]:
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
        for rid in finished:
            self._ending.setdefault(rid, _Ending()).handles.extend(self._in_flight.pop(rid, []))
        t = self.link.transfer
        for rid in [r for r, e in self._ending.items() if all(h.committed.done() for h in e.handles)]:
            ending = self._ending.pop(rid)
            self.stats.store_failures += sum(1 for h in ending.handles if h.committed.exception() is not None)
            if t is not None:
                try:
                    t.end_session_soon(rid)
                except Exception as e:
                    self.link.drop(t, e)

    def wait(self, until: float) -> None:
        """Wait for every commit in flight, until the monotonic time `until` at most."""
        for hs in [*self._in_flight.values(), *(e.handles for e in self._ending.values())]:
            for h in hs:
                try:
                    h.wait_committed(max(0.0, until - time.monotonic()))
                except Exception:
                    pass  # counted when its request ends


def _unknown_engine(e: BaseException) -> bool:
    """The server's answer that it does not know the engine (it restarted, or reclaimed it)."""
    return isinstance(e, ServerError) and e.code == ErrorCode.UNKNOWN_ENGINE
