"""vLLM 0.33's own scheduler and cache tensors on CPU, with a simulated forward: what the connector's tests and the
harness's `vllm` engine drive. The model is never built: `vllm_planning` gives its KV-cache config (vLLM's planner
over the specs the model's layers report, the block size from vLLM's hybrid alignment for a named attention
backend, FlashAttention on Hopper by default), and the pages a forward would write are derived from the token
prefix, so every loaded byte can be checked. Sliding-window layers are served by vLLM's own SlidingWindowManager:
blocks outside the window freed, null in the block table, neither written nor checked there.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hybridkv.model.layout import ModelLayout, layer_index

from hybridkv_bench.vllm_planning import plan_kv_cache


def page_bytes_for(prefix: np.ndarray, layer: str, nbytes: int) -> np.ndarray:
    """The bytes a forward 'writes' for a page that depends on the token prefix and the layer."""
    h = hashlib.blake2b(prefix.astype(np.int64).tobytes(), digest_size=32, person=layer.encode()[-16:])
    return np.resize(np.frombuffer(h.digest(), dtype=np.uint8), nbytes)


@dataclass(slots=True)
class StepReport:
    """What one engine step did: loads verified, corrupt pages found."""

    verified_pages: int = 0
    corrupt_pages: int = 0
    corrupt_blocks: set[int] = field(default_factory=set)  # block positions (in the request) with a bad page
    loaded_requests: list[str] = field(default_factory=list)


def _forward_order(name: str) -> tuple[int, str]:
    """A layer's place in the forward: its decoder-layer index (a name without one last)."""
    i = layer_index(name)
    return (i, "") if isinstance(i, int) else (1 << 30, name)


class OfflineEngine:
    """vLLM's Scheduler with the connector on both sides and a simulated forward over real cache tensors."""

    def __init__(self, vc, num_blocks: int = 256):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.vc = vc
        self.kv_cache_config, sched_cfg = plan_kv_cache(vc, num_blocks)
        block, hash_block = resolve_kv_cache_block_sizes(sched_cfg, vc)
        self.block_size = block
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_block, hash_fn)
        self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=sched_cfg,
                                   structured_output_manager=StructuredOutputManager(vc),
                                   block_size=block, hash_block_size=hash_block, log_stats=True)
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker: Any = None  # the worker-role connector (vLLM types it as KVConnectorBase)
        if vc.kv_transfer_config is not None:
            self.worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker.register_kv_caches(self.kv_caches)
        groups = self.kv_cache_config.kv_cache_groups
        self._recurrent = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "MambaSpec"]
        self._sliding = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"]
        self._page = {i: g.kv_cache_spec.page_size_bytes for i, g in enumerate(groups)}
        # the layers a forward's attention calls wait_for_layer_load for, in the order it reaches them
        self.attention_layers = sorted((n for i, g in enumerate(groups) if i not in self._recurrent
                                        for n in g.layer_names), key=_forward_order)
        self._tokens: dict[str, np.ndarray] = {}
        self.reports: list[StepReport] = []
        self.scheduler_stats: list[Any] = []  # vLLM's SchedulerStats of the steps with connector stats or lookups
        self.zeroed_blocks = 0

    @property
    def layout(self) -> ModelLayout:
        assert self.worker is not None
        return self.worker.layout

    def add_request(self, rid: str, token_ids: Iterable[int], max_tokens: int = 1, *,
                    lora: tuple[str, int] | None = None, images: Iterable[tuple[str, int, int]] = ()) -> None:
        """Queue a request; `lora` = (adapter name, id) puts a LoRARequest on it, `images` = (mm hash, offset,
        length) per image places that many placeholder tokens (an image the simulated forward never encodes)."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.request import Request

        tokens = [int(t) for t in token_ids]
        self._tokens[rid] = np.asarray(tokens, dtype=np.int64)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=h, mm_position=PlaceholderRange(at, n),
                                    mm_hash=h) for h, at, n in sorted(images, key=lambda x: x[1])]
        if mm and self.scheduler.max_num_encoder_input_tokens == 0:
            self._allow_images()
        lora_request = LoRARequest(lora[0], lora[1], f"/adapters/{lora[0]}") if lora else None
        self.scheduler.add_request(Request(rid, tokens, sp, None, mm_features=mm or None, lora_request=lora_request,
                                           block_hasher=self._hasher))

    def _allow_images(self) -> None:
        """Give the scheduler an encoder budget and cache (a text model's are 0: it would never schedule a
        placeholder), so image requests run; their encoder outputs are never computed, like the rest of the forward."""
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        budget = self.vc.scheduler_config.max_num_batched_tokens
        self.scheduler.max_num_encoder_input_tokens = budget
        self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=budget)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def _page_view(self, layer: str, group: int, block_id: int) -> torch.Tensor:
        return self.kv_caches[layer][block_id].view(-1).view(torch.uint8)

    def _write_pages(self, rid: str, blocks: tuple[list[int], ...], start: int, end: int) -> None:
        """The simulated forward over tokens [start, end): attention pages of the blocks it completes or
        touches, and the GDN state after token `end` in the block vLLM keeps it in."""
        tokens = self._tokens[rid]
        for g, grp in enumerate(self.kv_cache_config.kv_cache_groups):
            if g in self._recurrent:
                idx = (end - 1) // self.block_size
                if idx < len(blocks[g]) and blocks[g][idx] != 0:
                    for layer in grp.layer_names:
                        v = self._page_view(layer, g, blocks[g][idx])
                        v.copy_(torch.from_numpy(page_bytes_for(tokens[:end], layer, v.numel())))
                continue
            for j in range(start // self.block_size, (end - 1) // self.block_size + 1):
                hi = min((j + 1) * self.block_size, end)
                if blocks[g][j] == 0:
                    continue  # the null block: a sliding window's position vLLM keeps no KV for
                for layer in grp.layer_names:
                    v = self._page_view(layer, g, blocks[g][j])
                    v.copy_(torch.from_numpy(page_bytes_for(tokens[:hi], layer, v.numel())))

    def verify(self, rid: str, blocks: tuple[list[int], ...], h: int, report: StepReport) -> None:
        """Check a request's first h tokens: every attention page and the state of token h."""
        tokens = self._tokens[rid]
        for g, grp in enumerate(self.kv_cache_config.kv_cache_groups):
            idxs = [(h - 1) // self.block_size] if g in self._recurrent else range(h // self.block_size)
            for j in idxs:
                if g in self._sliding and blocks[g][j] == 0:
                    continue  # outside the window: vLLM holds (and reads) nothing there
                hi = h if g in self._recurrent else (j + 1) * self.block_size
                for layer in grp.layer_names:
                    v = self._page_view(layer, g, blocks[g][j]).numpy()
                    ok = np.array_equal(v, page_bytes_for(tokens[:hi], layer, v.size))
                    report.verified_pages += ok
                    report.corrupt_pages += not ok
                    if not ok:
                        report.corrupt_blocks.add(j)

    def step(self, after_schedule=None):
        """One scheduler step: schedule, connector loads, verify loaded prefixes, forward, stores, update."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        so = self.scheduler.schedule()
        if after_schedule is not None:  # an abort or preemption arriving while the step is in flight
            after_schedule(so)
        report = StepReport()
        # vLLM's worker zeroes new blocks before any load: a reused block's stale bytes never pass for a load
        for block_id in so.new_block_ids_to_zero or ():
            for t in self.kv_caches.values():
                t[block_id].zero_()
        meta = so.kv_connector_metadata
        # and every block a load is to write is zeroed here too (vLLM leaves reused attention blocks as they
        # are): bytes an earlier request left there can never pass for a load that did not happen
        for job in getattr(meta, "loads", ()):
            for block_id in job_blocks(self.layout, self.worker.chunk_tokens, job):
                for t in self.kv_caches.values():
                    t[block_id].zero_()
                self.zeroed_blocks += 1
        w = self.worker
        if w is not None and meta is not None:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            for name in self.attention_layers:  # each attention layer waits for its pages before it reads them
                w.wait_for_layer_load(name)
        # loads are asynchronous: a request is scheduled with a hit only once its load is done (or it failed and
        # vLLM recomputes it; load_mode layerwise: its GDN states, and its attention pages the waits above
        # waited for), so every scheduled prefix is checked here
        for nr in so.scheduled_new_reqs:
            if nr.num_computed_tokens:
                self.verify(nr.req_id, tuple(nr.block_ids), nr.num_computed_tokens, report)
                report.loaded_requests.append(nr.req_id)
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran: vLLM drops its output
            blocks = tuple(list(b) for b in self.scheduler.kv_cache_manager.get_block_ids(rid))
            end = req.num_computed_tokens  # schedule() already advanced it past this step's tokens
            start = end - n
            if end <= len(self._tokens[rid]):
                self._write_pages(rid, blocks, start, end)
            req_ids.append(rid)
            sampled.append([7] if end >= req.num_tokens else [])
        out = KVConnectorOutput()
        if w is not None and meta is not None:
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            out.finished_sending, out.finished_recving = results.finished_sending, results.finished_recving
            out.failed_recving = results.failed_recving
            out.invalid_block_ids = w.get_block_ids_with_load_errors()
            out.kv_connector_stats = w.get_kv_connector_stats()
            out.kv_cache_events = w.get_kv_connector_kv_cache_events()
            out.kv_connector_worker_meta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=out)
        for eco in self.scheduler.update_from_output(so, mro).values():
            st = eco.scheduler_stats
            if st is not None and (st.kv_connector_stats or (st.connector_prefix_cache_stats is not None
                                                               and st.connector_prefix_cache_stats.requests)):
                self.scheduler_stats.append(st)
        self.reports.append(report)
        return so, report

    def step_until_scheduled(self, timeout_s: float = 30.0):
        """Step until a new request is scheduled (a hit's asynchronous load is done first): that step's
        (scheduler output, report)."""
        until = time.monotonic() + timeout_s
        while True:
            so, rep = self.step()
            if so.scheduled_new_reqs:
                return so, rep
            if time.monotonic() > until:
                raise TimeoutError(f"no new request was scheduled in {timeout_s:g} s")
            time.sleep(0.002)

    def run(self, max_steps: int = 1000, max_idle_s: float = 120.0) -> StepReport:
        """Step until no request is left; the sum of the steps' reports. Steps that schedule nothing (only
        loads in flight) do not count against `max_steps`; they may last `max_idle_s` in all."""
        total = StepReport()
        steps, idle_until = 0, time.monotonic() + max_idle_s
        while self.scheduler.has_requests():
            so, r = self.step()
            if so.total_num_scheduled_tokens:
                steps += 1
            elif time.monotonic() > idle_until:
                raise RuntimeError(f"loads still in flight after {max_idle_s:g} s of idle steps")
            else:
                time.sleep(0.002)  # only loads in flight: vLLM's engine loop polls them the same way
            if steps > max_steps:
                raise RuntimeError(f"requests still running after {max_steps} steps")
            total.verified_pages += r.verified_pages
            total.corrupt_pages += r.corrupt_pages
            total.loaded_requests += r.loaded_requests
        return total

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        conn = self.scheduler.connector
        if conn is not None:
            conn.shutdown()


def job_blocks(layout: ModelLayout, chunk_tokens: int, job) -> set[int]:
    """The blocks a load writes: the hit's attention and sliding-window blocks past the local hit (a sliding
    window's only where vLLM holds one), and the state block."""
    out: set[int] = set()
    first, n = job.skip_tokens // chunk_tokens, len(job.token_ids) // chunk_tokens
    for g, grp in enumerate(layout.groups):
        bpc = chunk_tokens // grp.block_tokens
        ids = job.block_ids[g]
        out.update(ids[first * bpc:n * bpc] if grp.kind != "recurrent" else ids[n * bpc - 1:n * bpc])
    out.discard(0)  # the null block is never loaded into
    out.discard(-1)  # nor a hole (hybridkv's name for vLLM's null block in a job)
    return out
