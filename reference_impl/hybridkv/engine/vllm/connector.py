"""HybridKVConnector: vLLM 0.33's KV-connector interface (KVConnectorBase_V1 + SupportsHMA) over hybridkv.
SupportsHMA keeps vLLM's hybrid KV-cache manager on: sliding-window layers get groups of their own, whose
blocks outside the window vLLM frees (and hybridkv neither stores nor loads).

Load it without patching vLLM:
    --kv-transfer-config '{"kv_connector": "HybridKVConnector",
                           "kv_connector_module_path": "hybridkv.engine.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"endpoint": "ipc:///tmp/hybridkv/server.sock"}}'
The scheduler half (`SchedulerSide`) keeps the books; the worker half (`WorkerSide`) moves bytes with KVTransfer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.engine.vllm.events import HybridKVEvents, KVEventTracker, events_enabled
from hybridkv.engine.vllm.health import WorkerHealth
from hybridkv.engine.vllm.layout_from_vllm import (
    check_matches_preset,
    layout_from_kv_cache_config,
    vllm_model_identity,
)
from hybridkv.engine.vllm.plan import HybridKVMetadata
from hybridkv.engine.vllm.scheduler_side import SchedulerSide
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.engine.vllm.stats import (
    SCHEDULER_FIELDS,
    WORKER_FIELDS,
    HybridKVPromMetrics,
    HybridKVStats,
    IntervalCounter,
)
from hybridkv.engine.vllm.worker_side import WorkerSide
from hybridkv.model.layout import LayoutError, ModelLayout

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads every KV-cache group of a hybrid model (attention blocks and GDN boundary states) to hybridkv."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss, never a lost request

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(tc.kv_connector_extra_config)
        check_supported(vllm_config)
        parallel = vllm_config.parallel_config
        self.layout = layout_from_kv_cache_config(kv_cache_config, vllm_model_identity(vllm_config),
                                                  parallel.tensor_parallel_size)
        if self.settings.expect_preset:
            check_matches_preset(self.layout, self.settings.expect_preset)
        block = min(g.block_tokens for g in self.layout.groups)
        self.chunk_tokens = self.settings.chunk_tokens or self.layout.default_chunk_tokens()
        if self.chunk_tokens % block:
            raise LayoutError(f"chunk_tokens {self.chunk_tokens} is not a multiple of vLLM's block size {block}")
        self.layout.check_chunk_tokens(self.chunk_tokens)
        check_chunk_states(self.layout, self.chunk_tokens, block,
                           vllm_config.cache_config.prefix_cache_retention_interval)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self._requests: dict[str, Request] = {}
        self._interval = IntervalCounter(SCHEDULER_FIELDS if role == KVConnectorRole.SCHEDULER else WORKER_FIELDS)
        self.events = events_enabled(vllm_config)  # vLLM publishes KV events (--kv-events-config)
        tp = max(1, parallel.tensor_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            tracker = KVEventTracker(self.layout, self.chunk_tokens, hash_block_size(kv_cache_config, vllm_config),
                                     tp, event_group_kinds(kv_cache_config)) if self.events else None
            self.scheduler_side = SchedulerSide(self.settings, self.layout, self.chunk_tokens, tp, tracker)
        else:
            self.worker_side = WorkerSide(self.settings, self.layout, self.chunk_tokens, parallel.rank % tp,
                                          self.events, tp)

    # ---- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker_side is not None:
            self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker_side is not None:
            self.worker_side.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """load_mode layerwise: order this attention layer after its own pages of the step's loads; async: the
        loads ended before the request was scheduled."""
        if self.worker_side is not None and self.worker_side.layerwise is not None:
            # vLLM starts a step's loads before its forward only where it was told of loads to wait for
            # (`has_sync_kv_loads`, set by the scheduler side); should a vLLM run start_load_kv after the forward,
            # the first attention layer starts them itself
            self.worker_side.start_step_loads(self._meta())
            self.worker_side.layerwise.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        pass  # stores run after the whole forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker_side is not None:
            self.worker_side.save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ended (failed ones too: vLLM recomputes those per request, never an engine error)."""
        if self.worker_side is None:
            return KVConnectorTransferResults()
        self.worker_side.request_finished(finished_req_ids)
        finished, failed = self.worker_side.transfer_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_kv_connector_kv_cache_events(self) -> HybridKVEvents | None:
        """This worker's stores that ended since the last step, for the scheduler side's KV events."""
        if self.worker_side is None or not self.events:
            return None
        reports = self.worker_side.take_store_reports()
        return HybridKVEvents(reports) if reports else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This rank's connection state when it changed (`health.WorkerHealth`): the scheduler side offers no hit
        a rank cannot load."""
        return self.worker_side.health_report() if self.worker_side is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failures are per request (failed_recving): vLLM refuses block errors with several groups

    def _meta(self) -> HybridKVMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridKVMetadata)
        return meta

    # ---- scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler_side is None:
            return 0, False
        self._requests.setdefault(request.request_id, request)
        hit, _ = self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)
        self.scheduler_side.ask_for_states(request, num_computed_tokens + (hit or 0))
        # the load (load_mode layerwise: its server part and GDN states) is asynchronous: the request waits in
        # vLLM's queue, never the step
        return hit, bool(hit)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler_side is None:
            return HybridKVMetadata()
        return self.scheduler_side.build_connector_meta(scheduler_output, self._requests)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' outputs of a step, summed by vLLM: their store reports become KV events, their failed loads
        end the layer-wise loads that would have followed, their connection states gate the hits offered."""
        reports = connector_output.kv_cache_events
        side = self.scheduler_side
        if side is not None and connector_output.failed_recving:
            side.load_failed(set(connector_output.failed_recving))
        if side is not None and isinstance(health := connector_output.kv_connector_worker_meta, WorkerHealth):
            side.worker_health(health.states)
        if side is not None and side.events is not None and isinstance(reports, HybridKVEvents):
            side.events.reported(reports.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events for vLLM's publisher (`hybridkv.engine.vllm.events`): what this deployment now holds in
        hybridkv (BlockStored, medium CPU), what lookups found evicted (BlockRemoved), the reset
        (AllBlocksCleared)."""
        side = self.scheduler_side
        return side.events.take() if side is not None and side.events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if self.scheduler_side is not None:
            self.scheduler_side.request_finished(request)
        return False, None  # stores copied their pages inside the step: the blocks are free now

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's hits-by-source metric: memory (L1) is HOST, a prefix read back from the server's disk DISK."""
        if num_external_tokens == 0 or self.scheduler_side is None:
            return {}
        tier = self.scheduler_side.hit_tier(request.request_id)
        source = {"l1": CacheHitSource.HOST, "l2": CacheHitSource.DISK}.get(tier or "",
                                                                             CacheHitSource.EXTERNAL_UNSPECIFIED)
        return {source: num_external_tokens}

    # ---- statistics (both sides; vLLM sums the workers' and the scheduler's) ----------------------------

    def reset_cache(self) -> bool | None:
        """Drop what this deployment stored in hybridkv (vLLM's `reset_prefix_cache(reset_connector=True)`)."""
        return self.scheduler_side.reset_cache() if self.scheduler_side is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters since the last call (`hybridkv.engine.vllm.stats.COUNTERS`)."""
        side = self.scheduler_side or self.worker_side
        return self._interval.interval(side.stats) if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HybridKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.close()
        if self.worker_side is not None:
            self.worker_side.close()


def hash_block_size(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig) -> int:
    """The granularity of vLLM's `Request.block_hashes` (the engine sets it on the config; else vLLM's rule)."""
    hbs = getattr(kv_cache_config, "hash_block_size", None)
    if hbs:
        return int(hbs)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]


def event_group_kinds(kv_cache_config: KVCacheConfig) -> list[str | None]:
    """vLLM's KVCacheSpecKind of each KV-cache group, as its own BlockStored events name them."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in kv_cache_config.kv_cache_groups]


def check_chunk_states(layout: ModelLayout, chunk_tokens: int, block: int, retention: int | None) -> None:
    """A hybrid's chunk longer than vLLM's block is resumable only where vLLM kept a GDN state at its end: vLLM keeps
    one at a prompt's last block boundary, at shared-prefix junctions and every `retention` tokens (None: at every
    block), so unless the retention interval divides the chunk, few chunk ends have one and few prompts could hit.
    Refused at start, saying why."""
    if not layout.recurrent_groups or chunk_tokens == block or retention is None or (
            retention and chunk_tokens % retention == 0):
        return
    raise ValueError(
        f"kv_connector_extra_config chunk_tokens {chunk_tokens} spans {chunk_tokens // block} of vLLM's {block}-token "
        f"blocks, but vLLM keeps a GDN state only at a prompt's last block boundary and every "
        f"--prefix-cache-retention-interval tokens ({retention}), so few chunk ends would have a state to store: use "
        f"chunk_tokens 0 (vLLM's block) or a --prefix-cache-retention-interval that divides {chunk_tokens}")


def check_supported(vllm_config: VllmConfig) -> None:
    """Refuse at start-up, naming the setting, what the connector cannot serve correctly."""
    cache, tc = vllm_config.cache_config, vllm_config.kv_transfer_config
    assert tc is not None
    # a model with Mamba/GDN layers also needs them in align mode (a state per block boundary), which prefix
    # caching selects: layout_from_kv_cache_config refuses a Mamba group in any other mode
    if not cache.enable_prefix_caching:
        raise ValueError("HybridKVConnector needs --enable-prefix-caching (which puts Mamba/GDN caching in align mode: "
                         f"a state per block boundary); got prefix caching {cache.enable_prefix_caching}, "
                         f"mamba_cache_mode {cache.mamba_cache_mode!r}")
    if tc.kv_load_failure_policy != "recompute":
        raise ValueError("HybridKVConnector needs kv_load_failure_policy 'recompute' in --kv-transfer-config: "
                         f"a lost load must cost a recompute, not fail the request (got {tc.kv_load_failure_policy!r})")
    if tc.kv_role != "kv_both":
        raise ValueError(f"HybridKVConnector needs kv_role 'kv_both' in --kv-transfer-config (got {tc.kv_role!r}): "
                         "the same engine stores and loads")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("HybridKVConnector does not support pipeline parallelism: set --pipeline-parallel-size 1 "
                         f"(got {vllm_config.parallel_config.pipeline_parallel_size})")
    if vllm_config.model_config.enable_sleep_mode:
        raise ValueError("HybridKVConnector does not support sleep mode: sleeping frees the KV cache that the "
                         "connector's copies read and write; start vLLM without --enable-sleep-mode")
    if vllm_config.speculative_config is not None:
        raise ValueError("HybridKVConnector does not support speculative decoding (its extra state blocks are not "
                         "cached): remove --speculative-config")
