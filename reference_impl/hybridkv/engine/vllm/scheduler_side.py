"""The connector's scheduler half: turns lookups into external hits (`scheduler_hits.HitBook`, over the server
connection of `scheduler_link.SchedulerLink`) and builds each step's metadata: the loads planned into the blocks
vLLM allocated, and stores of the chunks whose boundary state vLLM offers. It never moves a byte.

A server that is down, slow or refusing costs hits: every call here has a short timeout, and any failure
is a miss, logged. A connection that failed is made again on a thread of its own the moment the server answers
a probe (`health.Reconnector`); a server that answers `unknown_engine` (restarted) gets a new registration at
once, and the lookup is asked again. Hits are offered only while every worker rank can load them
(`health.WorkerHealth`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hybridkv.engine.vllm.books import HitTier, RequestTrack, SchedulerStats
from hybridkv.engine.vllm.checkpoints import ask_for_state
from hybridkv.engine.vllm.health import ConnState
from hybridkv.engine.vllm.layerwise import promoted
from hybridkv.engine.vllm.plan import HybridKVMetadata, StoreJob, boundary_stores, step_stores
from hybridkv.engine.vllm.scheduler_hits import HitBook
from hybridkv.engine.vllm.scheduler_link import SchedulerLink
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.model.layout import ModelLayout
from hybridkv.wire import protocol as P

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from hybridkv.engine.vllm.events import KVEventTracker  # (it imports vLLM)

log = logging.getLogger(__name__)

RESET_TIMEOUT_S = 5.0  # how long vLLM's reset of the external cache waits for the server's answer


class SchedulerSide:
    """Lookups and transfer plans for one vLLM scheduler. Each tensor-parallel rank stores its own shard under
    its own namespace, so the scheduler registers once per rank and a hit is what every rank holds (the
    shortest of the ranks' prefixes), pinned on every rank until the request ends."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_size: int = 1,
                 events: KVEventTracker | None = None):
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.events = events  # KV events for vLLM's publisher; None when it publishes none
        self.stats = SchedulerStats()
        self.link = SchedulerLink(settings, layout, chunk_tokens, tp_size)
        self.hits = HitBook(self.link, layout, self.stats, events)

    @property
    def server_epoch(self) -> int:
        """Registrations since the first: the workers check theirs when it moves."""
        return self.link.server_epoch

    def worker_health(self, states: dict[int, ConnState]) -> None:
        """Worker ranks' connection states that changed (`health.WorkerHealth`, from the step's outputs)."""
        self.link.worker_health(states)

    def workers_can_load(self) -> bool:
        return self.link.workers_can_load()

    # ---- vLLM's scheduler calls: hits (`scheduler_hits`) ----------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External hit beyond the local one (`HitBook.get_num_new_matched_tokens`)."""
        return self.hits.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: plan the load of the hit it accepted."""
        self.hits.update_state_after_alloc(request, blocks, num_external_tokens)

    def load_failed(self, request_ids: set[str]) -> None:
        self.hits.load_failed(request_ids)

    def hit_tier(self, request_id: str) -> HitTier | None:
        return self.hits.hit_tier(request_id)

    def request_finished(self, request: Request) -> None:
        self.hits.request_finished(request)

    def wait_idle(self, timeout_s: float) -> None:
        self.hits.wait_idle(timeout_s)

    # ---- each step's metadata -------------------------------------------------------------------

    def ask_for_states(self, request: Request, done: int) -> None:
        """Before a request's next step (it will have computed `done` tokens): ask vLLM to keep the GDN state at
        the next boundary of the `state_every_chunks` grid (`checkpoints.py`). Models without recurrent groups
        keep nothing of the kind."""
        every = self.settings.state_every_chunks
        decoding = done >= request.num_prompt_tokens
        if every and decoding:
            # decode ends a step at every token anyway: a state at each chunk of the answer costs its bytes only,
            # and the next chat turn resumes at the answer's last whole chunk whatever the prefill grid is
            every = 1
        if self.layout.recurrent_groups:
            ask_for_state(request, done, every * self.chunk_tokens, nearer=decoding)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> HybridKVMetadata:
        """This step's loads, and stores of the chunks up to each boundary state vLLM offers (a model without
        recurrent groups: of every chunk this step completes)."""
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            if (req := requests.get(rid)) is not None:
                # computed by the end of this step (vLLM adds `scheduled` after this call), of tokens known now: under
                # async scheduling decode's last token is a placeholder until the next step, and vLLM keeps the
                # state of a block whose last token it does not know yet only once it does, at the same junction
                self.ask_for_states(req, min(req.num_computed_tokens + scheduled, req.num_tokens))
        meta = HybridKVMetadata(loads=self.hits.loads, server_epoch=self.link.server_epoch)
        self.hits.loads = []
        if self.hits.held and (step_loads := promoted(self.hits.held, requests)):
            meta.step_loads = step_loads  # their blocks are in vLLM's prefix cache from this step on
            scheduler_output.has_sync_kv_loads = True  # so vLLM starts this step's loads before its forward
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return meta
        if not self.layout.recurrent_groups:
            meta.stores.extend(self._plan_step_stores(scheduler_output, requests, state))
            return meta
        for rid, offers in state.boundary_state_offloads.items():
            req, track, blocks = requests.get(rid), self.hits.requests.get(rid), state.get_block_ids(rid)
            if req is not None and track is not None and blocks is not None:
                meta.stores.extend(self._count(track, req, boundary_stores(self.layout, self.chunk_tokens, req,
                                                                           offers, blocks, track.stored_chunks)))
        return meta

    def _plan_step_stores(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                          state) -> list[StoreJob]:
        """Attention and sliding-window groups alone (Gemma 3, gpt-oss): every chunk this step completes."""
        jobs = []
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            if (req := requests.get(rid)) is None or (track := self.hits.requests.get(rid)) is None:
                continue
            # computed by the end of this step; only known tokens (an async step's next input is a placeholder)
            end = min(req.num_computed_tokens + scheduled, req.num_tokens)
            if end // self.chunk_tokens > track.stored_chunks and (blocks := state.get_block_ids(rid)) is not None:
                jobs.extend(self._count(track, req, step_stores(self.layout, self.chunk_tokens, req, end, blocks,
                                                                track.stored_chunks)))
        return jobs

    def _count(self, track: RequestTrack, req: Request, jobs: list[StoreJob]) -> list[StoreJob]:
        """Stores planned for a request: it is stored up to their last chunk (KV events: each is announced once
        every rank committed it)."""
        for job in jobs:
            end = len(job.token_ids) // self.chunk_tokens
            if self.events is not None:
                self.events.planned(req, job.start_chunk, end)
            track.stored_chunks = max(track.stored_chunks, end)
            self.stats.stores_planned += 1
        return jobs

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (`POST /reset_prefix_cache?reset_external=true`):
        drop every object this deployment's ranks stored, from the server's memory and disk. Objects pinned by
        running requests stay, as vLLM's own reset leaves running requests' blocks. False when the server is
        unreachable or did not confirm within RESET_TIMEOUT_S (vLLM's engine waits for this call; the server may
        still finish the drop)."""
        if not self.link.connect(at_start=True):
            return False
        try:
            dropped = sum(d.count for d in self.link.ask_ranks([P.Clear(engine=e) for e, _ in self.link.ranks],
                                                            RESET_TIMEOUT_S))
        except Exception as e:
            log.warning("hybridkv: the cache server did not confirm the reset (%s)", e)
            self.link.drop(e)
            return False
        log.info("hybridkv: reset: the cache server dropped %d objects of this deployment", dropped)
        if self.events is not None:
            self.events.cleared()
        return True

    def close(self) -> None:
        self.link.close()
