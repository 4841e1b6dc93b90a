"""The connector's worker half: `hybridkv.engine.transfer.KVTransfer` moves the bytes, the same code the
CUDA suite covers on the GPU machine. This file is what a worker rank does in each of vLLM's steps; how it loads
is `worker_loads.py`, how it stores `worker_stores.py`, its server connection `worker_link.py`.

Nothing here makes vLLM's step wait on the cache server longer than `lookup_timeout_s` / `step_timeout_s`:
loads are asynchronous (the request waits in vLLM's queue, never the step), a store's copies are awaited for at
most `step_timeout_s`, and a connection that failed is made again off the step. Copies start after the work the
engine queued on its current stream before the step asked for them (vLLM zeroes new blocks there).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from hybridkv.engine.paged import engine_pages
from hybridkv.engine.transfer import KVTransfer
from hybridkv.engine.vllm.events import StoreReports
from hybridkv.engine.vllm.health import ConnState, WorkerHealth
from hybridkv.engine.vllm.layerwise import LayerwiseLoads, tp_vote
from hybridkv.engine.vllm.plan import HybridKVMetadata
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.engine.vllm.stats import WorkerStats
from hybridkv.engine.vllm.worker_link import WorkerLink
from hybridkv.engine.vllm.worker_loads import WorkerLoads
from hybridkv.engine.vllm.worker_stores import WorkerStores
from hybridkv.model.layout import ModelLayout
from hybridkv.wire import protocol as P

if TYPE_CHECKING:
    import torch


class WorkerSide:
    """One vLLM worker rank's transfers."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_rank: int,
                 events: bool = False, tp_size: int = 1):
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_rank = tp_rank
        self.stats = WorkerStats()
        self.link = WorkerLink(settings, layout, chunk_tokens, tp_rank, self._forget, self._close_dropped)
        self.layerwise = LayerwiseLoads(layout, self.stats, settings.timeout_s, tp_vote(tp_size)) \
            if settings.load_mode == "layerwise" else None
        self.loads = WorkerLoads(self.link, self.stats, self.layerwise)
        # vLLM publishes KV events: how each store ended, for the scheduler side's (`hybridkv.engine.vllm.events`)
        self.stores = WorkerStores(self.link, self.stats, StoreReports(tp_rank, chunk_tokens) if events else None)

    @property
    def transfer(self) -> KVTransfer | None:
        """The server connection; None while there is none (a reconnect is under way)."""
        return self.link.transfer

    @property
    def _pages(self) -> list[list[torch.Tensor]] | None:
        return self.link.pages

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Page views of vLLM's cache tensors, checked against the layout, then the server connection (at
        start-up a layout the server refuses is an error; later it is a miss)."""
        self.link.pages = engine_pages(self.layout, kv_caches)
        self.link.connect(at_start=True)

    def health(self) -> ConnState:
        return self.link.health()

    def health_report(self) -> WorkerHealth | None:
        return self.link.health_report()

    def _forget(self) -> None:
        """The connection was dropped (under the link's lock): nothing in flight on it will be heard of."""
        self.stores.forget()

    def _close_dropped(self, t: KVTransfer) -> None:
        """Close a dropped connection on a thread of its own (close waits for its work), or once the layer-wise
        hits held in its arena are copied."""
        if self.layerwise is None or not self.layerwise.close_when_unheld(t):
            threading.Thread(target=t.close, name="hkv-vllm-close", daemon=True).start()

    # ---- vLLM's step ----------------------------------------------------------------------------

    def start_load(self, meta: HybridKVMetadata) -> None:
        """Before the forward: check this rank's registration where the scheduler side registered again, start
        the in-step attention copies (load_mode layerwise), reserve this step's stores (their round trips overlap
        the forward), then start every planned load (`worker_loads`; nothing here waits for a copy)."""
        self.link.follow_scheduler(meta.server_epoch)
        self.start_step_loads(meta)
        self.stores.prepare(meta.stores)
        if meta.loads:
            self.loads.start(meta.loads, self._ready_event())

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

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) loads since the last call; a failed one is also finished (vLLM's contract)."""
        return self.loads.results()

    def save(self, meta: HybridKVMetadata) -> None:
        """After the forward: end this step's in-step loads (layerwise), then copy every planned store out of
        vLLM's blocks (`worker_stores`)."""
        if self.layerwise is not None:  # this step's in-step loads end before anything later reads their blocks
            self.layerwise.end_step(self._engine_stream())
        self.stores.save(meta.stores, self._engine_stream())

    def _engine_stream(self):
        """vLLM's current CUDA stream (its forward's), or None on a CPU engine (copies there run on threads:
        only waiting orders them before vLLM's next writes)."""
        pages = self.link.pages
        if pages is None or pages[0][0].device.type != "cuda":
            return None
        import torch

        return torch.cuda.current_stream(pages[0][0].device)

    def take_store_reports(self) -> list[tuple[int, str, int, int, bool]]:
        """(rank, request, first chunk, end chunk, held in full) of every store that ended since the last call."""
        return self.stores.take_reports()

    def request_finished(self, finished: set[str]) -> None:
        """End the server sessions of finished requests once their commits are in (without waiting)."""
        if self.layerwise is not None:
            self.layerwise.finished(finished)
        self.stores.request_finished(finished)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait for every load and in-flight commit, then end the sessions of finished requests whose commits
        were all that kept them open (the harness, tests and shutdown): after this the server holds none of
        their pins."""
        until = time.monotonic() + timeout_s
        self.loads.wait(until)
        self.stores.wait(until)
        self.request_finished(set())
        if (t := self.link.transfer) is not None:
            try:
                t.client.call(P.Health(), timeout=max(0.1, until - time.monotonic()))
            except Exception:
                pass

    def close(self) -> None:
        self.link.close()
        if (t := self.link.transfer) is not None:
            self.wait_idle(self.settings.timeout_s)
            t.close()
            self.link.transfer = None
