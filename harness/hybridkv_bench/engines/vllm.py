"""The `vllm` engine kind: vLLM 0.33's own scheduler and KV-cache allocator drive the hybridkv connector
(`hybridkv.engine.vllm`), so every hit, block id and state block is the one vLLM produces. The forward is
simulated (`hybridkv_bench.vllm_offline`): pages are derived from the token prefix and every page a load
wrote is checked before the forward runs. vLLM's own prefix cache is emptied before each request, so every
hit a request gets is hybridkv's. One scheduler step prefills one chunk and vLLM keeps a GDN state at every
chunk, as the simulated engine's `all` store policy does.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from hybridkv.engine.config import TransferConfig
from hybridkv.engine.vllm.settings import kv_transfer_config
from hybridkv.model.presets.gated_deltanet import HybridModelConfig

from hybridkv_bench import vllm_offline as offline
from hybridkv_bench import vllm_planning as planning
from hybridkv_bench.engines.base import EngineSite, HitMismatch, RequestResult, refuse_gate

_MODEL_CONFIGS: dict[tuple[HybridModelConfig, int], object] = {}  # vLLM inspects an architecture for ~30 s


class VllmEngine:
    """One vLLM engine (scheduler + one worker rank) with the connector, run request by request."""

    def __init__(self, cfg: HybridModelConfig, endpoint: str, transfer: TransferConfig, chunk_tokens: int, salt: str,
                 prefill: Callable[[int, int], float], max_tokens: int, timeout_s: float):
        if cfg.kv_dtype != "bfloat16" or cfg.conv_dtype != "bfloat16":
            raise ValueError(f"the vllm engine builds bf16 KV caches; preset {cfg.name} has {cfg.kv_dtype}")
        key = (cfg, max_tokens)
        if key not in _MODEL_CONFIGS:
            folder = Path(tempfile.mkdtemp(prefix="hkv-vllm-model-"))
            atexit.register(shutil.rmtree, folder, True)  # vLLM may read the config again while it is cached
            _MODEL_CONFIGS[key] = planning.model_config(planning.write_config(cfg, folder),
                                                        max_model_len=max_tokens + 16)
        # the store policy is the oracle's: vLLM keeps a state at every chunk here, the connector stores each
        extra = {"salt": salt, "timeout_s": timeout_s, "lookup_timeout_s": timeout_s,
                 "chunk_tokens": chunk_tokens, "wire_format": transfer.wire_format, "copy_engine": transfer.copy_engine,
                 "streams": transfer.streams, "retrieve_policy": transfer.retrieve_policy}
        connector = kv_transfer_config(endpoint, **extra)
        vc = planning.vllm_config(_MODEL_CONFIGS[key], cfg, max_num_batched_tokens=chunk_tokens,
                                  kv_transfer=connector, retention_interval=chunk_tokens)
        blocks = 4 * (max_tokens // chunk_tokens + 2)
        self.engine = offline.OfflineEngine(vc, num_blocks=blocks)
        if self.engine.block_size != chunk_tokens:
            raise ValueError(f"vLLM's block is {self.engine.block_size} tokens, the scenario's chunk {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.prefill = prefill
        self.timeout_s = timeout_s
        self._sched = self.engine.scheduler.connector.scheduler_side
        self._worker = self.engine.worker.worker_side
        if self._worker.transfer is None:
            raise ConnectionError(f"the connector could not reach the cache server at {endpoint}")

    @property
    def kv(self):
        """The worker rank's KVTransfer (the runner clears its namespace between repeats)."""
        return self._worker.transfer

    @property
    def gpu(self) -> int:
        return -1  # no pools of the runner's: vLLM allocates its own

    def run(self, request_id: str, tokens: np.ndarray, gate: Callable[[str], None] | None = None) -> RequestResult:
        """One request through vLLM's scheduler until it finishes; hits verified page by page."""
        refuse_gate("vllm", gate)
        eng, w = self.engine, self._worker.stats
        if not eng.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache (a request is still running)")
        before = (w.load_s, w.store_s, w.loaded_bytes, w.stored_bytes, w.load_failures, w.store_failures)
        lookup_before = self._sched.stats.lookup_s
        eng.add_request(request_id, tokens.tolist())
        # loads are asynchronous: a request with a hit waits in vLLM's queue until its load is done
        so, first = eng.step_until_scheduled(self.timeout_s)
        hit = so.scheduled_new_reqs[0].num_computed_tokens
        total = eng.run()
        # committed and every session of the request ended, as the simulated engine's are: the runner's Clear
        # of the next repeat must find no pin of this request, else a Clear that overtakes the scheduler's
        # EndSession leaves the hit's objects, and the next repeat's hit is longer than its prompts allow
        self._worker.wait_idle(self.timeout_s)
        self._sched.wait_idle(self.timeout_s)
        if w.load_failures != before[4] or w.store_failures != before[5]:
            raise HitMismatch(f"{request_id}: the connector lost a load or a store (see its log)")
        if hit % self.chunk_tokens:
            raise HitMismatch(f"{request_id}: vLLM resumed at {hit} tokens, not a whole chunk")
        corrupt = {j * eng.block_size // self.chunk_tokens for j in first.corrupt_blocks | total.corrupt_blocks}
        hit_chunks = hit // self.chunk_tokens
        load_s, store_s = w.load_s - before[0], w.store_s - before[1]
        return RequestResult(hit_tokens=hit, lookup_s=self._sched.stats.lookup_s - lookup_before, load_s=load_s,
                             prefill_s=self.prefill(len(tokens) - hit, hit), store_s=store_s, store_done_s=store_s,
                             store_copy_s=store_s, load_copy_s=load_s, bytes_stored=w.stored_bytes - before[3],
                             bytes_loaded=w.loaded_bytes - before[2], verified_chunks=hit_chunks - len(corrupt),
                             corrupt_chunks=len(corrupt))

    def close(self) -> None:
        self.engine.close()


def build(site: EngineSite) -> VllmEngine:
    """The `vllm` engine kind: vLLM's scheduler with the connector, its own client and KV cache."""
    return VllmEngine(site.cfg, site.endpoint, site.transfer, site.chunk, site.salt, site.prefill, site.max_tokens,
                      site.timeout_s)
