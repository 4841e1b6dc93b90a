"""The `transformers` engine: a real hybrid model whose cache goes through KVTransfer to a cache server and back.

One request (`HFEngine.run`), the same life as `SimEngine.run` but with a model computing the pages:
1. allocate blocks for the prompt in every group (`EnginePools`, vLLM's shared per-layer buffers);
2. lookup (timed) on every token but the last: a hit must leave at least one token to compute, or there
   are no logits to answer with (vLLM caps external hits the same way);
3. on a hit: retrieve into the blocks (timed), rebuild a transformers cache from the pages;
4. prefill the uncached tokens (measured) in segments ending at every chunk whose recurrent state the store
   policy keeps, copying the state into that chunk's state block at each boundary; then the K/V of the new
   full blocks into their pages;
5. warm requests: the logits oracle (`hybridkv_bench.engines.hf.oracle`): the continuation from the restored cache
   against the same continuation from the in-memory cache this engine held at that split token (kept
   when it stored the boundary), bitwise, and against one full prefill of the prompt;
6. store every full chunk (timed to `committed`), end the session, free the blocks.

Times: `prefill_measured_s` is the model's forwards alone (cold: the whole prompt; warm: the continuation).
`adapter_s` is the copying between transformers' cache tensors and the pages, which vLLM does not pay (its
kernels read and write the pages themselves); it is kept apart and left out of both TTFTs. `prefill_s`
stays the scenario's modeled prefill, so measured and modeled sit side by side.
`verified_chunks` / `corrupt_chunks` count a warm hit's chunks as verified when its oracle passed, corrupt
when it failed: here the model's output is the check, not byte patterns.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hybridkv.engine.transfer import Hit, KVTransfer
from hybridkv.model.policy import chunk_objects

from hybridkv_bench.engines.base import EngineSite, RequestResult, gpu_of, refuse_gate
from hybridkv_bench.engines.hf.model import HFModel, build_model
from hybridkv_bench.engines.hf.oracle import Control, OracleVerdict, judge
from hybridkv_bench.engines.hf.pages import PageCodec
from hybridkv_bench.engines.pools import EnginePools
from hybridkv_bench.engines.sim import sim_transfer, timed_store

# In-memory caches kept for the oracle, one per stored state (a later request may resume at any of them):
# under `all` that is a deep copy per chunk, so on a GPU the reference costs memory and time, not the TTFT.
SNAPSHOTS = 4


class OracleError(RuntimeError):
    """The oracle could not run: no in-memory cache at the split the server's hit ends at."""


class HFEngine:
    """One engine rank running a transformers model over vLLM-shaped pages; see the module doc."""

    def __init__(self, kv: KVTransfer, hf: HFModel, pools: EnginePools, prefill: Callable[[int, int], float],
                 timeout_s: float = 600.0, before_retrieve: Callable[[Hit], None] | None = None,
                 control: Control | None = None, reserve_last_token: bool = True):
        self.kv, self.hf, self.pools = kv, hf, pools
        self.layout = pools.layout
        self.chunk_tokens = kv.chunk_tokens
        self.codec = PageCodec(hf, self.layout, pools.pages, self.chunk_tokens)
        self.prefill = prefill
        self.timeout_s = timeout_s
        self.before_retrieve = before_retrieve
        self.control = control                  # test hook: breaks the retrieved pages (oracle.CONTROLS)
        self.reserve_last_token = reserve_last_token  # False only in the control that must fail
        self.layerwise = hf.spec.load == "layerwise"
        self.tolerance = hf.spec.full_prefill_tolerance if hf.dtype == torch.float32 else None
        self._snapshots: OrderedDict[bytes, Any] = OrderedDict()
        self.last_verdict: OracleVerdict | None = None

    def _state_ends(self, start: int, tokens: int) -> list[int]:
        """Token positions after `start` where the store policy keeps a recurrent state."""
        n = tokens // self.chunk_tokens
        chunks = sorted({c for c, g in chunk_objects(self.layout, self.kv.config.store_policy, 0, n)
                         if self.layout.groups[g].kind == "recurrent"})
        return [(c + 1) * self.chunk_tokens for c in chunks if (c + 1) * self.chunk_tokens > start]

    def _snapshot(self, key: bytes, cache: Any) -> None:
        self._snapshots[key] = copy.deepcopy(cache)
        self._snapshots.move_to_end(key)
        while len(self._snapshots) > SNAPSHOTS:
            self._snapshots.popitem(last=False)

    def _continue(self, ids: torch.Tensor, cache: Any, start: int, ends: list[int], keep_from: int,
                  at_boundary: Callable[[int, Any], None] | None = None,
                  queue_at_once: bool = False) -> tuple[torch.Tensor, float]:
        """Prefill from `start`, or (a full-prompt hit, only when the last token is not reserved) feed the
        last token again: what an engine that takes the whole prompt from the cache ends up doing."""
        if start >= len(ids):
            self.hf.sync()
            t0 = time.perf_counter()
            logits = self.hf.forward(ids[-1:], cache, 1).float()
            self.hf.sync()
            return logits, time.perf_counter() - t0
        return self.hf.prefill(ids, cache, start, ends, keep_from, at_boundary, queue_at_once=queue_at_once)

    @property
    def gpu(self) -> int:
        return gpu_of(self.pools.device)

    def close(self) -> None:
        self.kv.close()

    def run(self, request_id: str, tokens: np.ndarray, gate: Callable[[str], None] | None = None) -> RequestResult:
        """One request from allocation to free; see the module doc for what is timed and checked."""
        refuse_gate("transformers", gate)
        kv, hf, C = self.kv, self.hf, self.chunk_tokens
        ids = torch.as_tensor(np.asarray(tokens) % hf.spec.vocab_size, dtype=torch.long, device=hf.device)
        S = len(ids)
        keys = kv.keys(tokens)
        blocks = [self.pools.allocator.allocate(n) for n in EnginePools.blocks_for(self.layout, S)]
        adapter_s = 0.0
        try:
            t0 = time.perf_counter()
            hit = kv.lookup(request_id, tokens[:S - 1] if self.reserve_last_token else tokens)
            lookup_s = time.perf_counter() - t0
            prepared = kv.prepare_store(request_id, tokens, block_ids=blocks)  # before load and prefill
            if self.before_retrieve is not None:
                self.before_retrieve(hit)
            h = hit.hit_tokens
            load_s = load_copy_s = 0.0
            loaded = 0
            reference = rh = None
            hooks: list[Any] = []
            ends = self._state_ends(h, S)
            state_ends = set(ends)
            if not ends or ends[-1] < S:
                ends.append(S)
            keep_from = h if hit.hit_chunks else S - 1
            alone: list[float] = []  # the forward alone, timed before the load and after the warm forward
            if hit.hit_chunks:
                reference = self._snapshots.get(hit.keys[hit.hit_chunks - 1])
                if reference is None:
                    raise OracleError(f"{request_id}: the hit ends at token {h}, where this engine kept no "
                                      "in-memory cache to compare with")
                if hf.spec.forward_alone_repeats > 1:
                    alone.append(self._continue(ids, copy.deepcopy(reference), h, ends, keep_from)[1])
                hf.sync()
                t_load = time.perf_counter()
                if self.layerwise:
                    # the continuation starts now; each layer waits for its own pages (pages.read_cache_layerwise)
                    rh = kv.retrieve(hit, blocks, layerwise=True)
                    if self.control is not None:  # a test's damage needs the pages written first
                        rh.wait(self.timeout_s)
                        self.control(self.codec, blocks, hit)
                    t0 = time.perf_counter()
                    cache, hooks = self.codec.read_cache_layerwise(blocks, hit.hit_chunks, rh, hf.decoder_layers)
                    adapter_s += time.perf_counter() - t0  # queued only: it runs inside the timed span
                else:
                    rh = kv.retrieve(hit, blocks).wait(self.timeout_s)
                    load_s, load_copy_s, loaded = time.perf_counter() - t_load, rh.copy_s, rh.nbytes
                    if self.control is not None:
                        self.control(self.codec, blocks, hit)
                    t0 = time.perf_counter()
                    cache = self.codec.read_cache(blocks, hit.hit_chunks)
                    hf.sync()
                    adapter_s += time.perf_counter() - t0
            else:
                cache = hf.new_cache()

            def at_boundary(end: int, c: Any) -> None:
                nonlocal adapter_s
                if end in state_ends:
                    t = time.perf_counter()
                    self.codec.write_states(c, blocks, end // C - 1)
                    hf.sync()
                    adapter_s += time.perf_counter() - t
                    self._snapshot(keys[end // C - 1], c)

            try:
                logits, prefill_measured_s = self._continue(ids, cache, h, ends, keep_from, at_boundary,
                                                            queue_at_once=bool(hooks))
            finally:
                for hook in hooks:
                    hook.remove()
            warm_span_s = None
            if hooks and rh is not None:  # layer-wise: the load ran beside the forward
                warm_span_s = time.perf_counter() - t_load
                rh.wait(self.timeout_s)
                load_s, load_copy_s, loaded = rh.t_done - t_load, rh.copy_s, rh.nbytes
            if S in state_ends:  # a chunk-aligned prompt: its last segment ends at a kept state
                at_boundary(S, cache)
            t0 = time.perf_counter()
            bpc = [C // g.block_tokens for g in self.layout.groups]
            first = hit.hit_chunks * bpc[0]
            if len(keys) * bpc[0] > first:
                self.codec.write_attention(cache, blocks, first, len(keys) * bpc[0])
            hf.sync()
            adapter_s += time.perf_counter() - t0
            verdict, forward_alone_s = (self._oracle(ids, reference, h, ends, keep_from, logits, alone)
                                        if reference is not None else (None, None))
            self.last_verdict = verdict
            del cache
            stored = timed_store(kv, request_id, tokens, blocks, self.timeout_s, prepared)
        finally:
            for b in blocks:
                self.pools.allocator.free(b)
        ok = verdict.passed if verdict else None
        return RequestResult(
            hit_tokens=h, lookup_s=lookup_s, load_s=load_s, prefill_s=self.prefill(S - h, h),
            prefill_measured_s=prefill_measured_s, adapter_s=adapter_s, warm_span_s=warm_span_s,
            forward_alone_s=forward_alone_s,
            load_copy_s=load_copy_s, store_s=stored.store_s, store_done_s=stored.store_done_s,
            store_copy_s=stored.store_copy_s, store_span_s=stored.store_span_s,
            bytes_stored=stored.bytes_stored, store_start=stored.start,
            bytes_loaded=loaded, verified_chunks=hit.hit_chunks if ok else 0,
            corrupt_chunks=hit.hit_chunks if ok is False else 0,
            logits_max_abs_diff=verdict.full_max_abs_diff if verdict else None,
            logits_bitwise_equal=verdict.bitwise_equal if verdict else None, oracle_pass=ok)

    def _oracle(self, ids: torch.Tensor, reference: Any, h: int, ends: list[int], keep_from: int,
                restored: torch.Tensor, alone: list[float]) -> tuple[OracleVerdict, float]:
        """Same continuation from the in-memory cache at the split, then one full prefill; judged. Also the
        seconds that continuation's forwards took, the warm forward with no load at all: the median of `alone`
        (timed before the load) and of the runs here, `forward_alone_repeats` in all."""
        split, forward_alone_s = self._continue(ids, copy.deepcopy(reference), h, ends, keep_from)
        alone = [*alone, forward_alone_s]
        while len(alone) < self.hf.spec.forward_alone_repeats:
            alone.append(self._continue(ids, copy.deepcopy(reference), h, ends, keep_from)[1])
        forward_alone_s = statistics.median(alone)
        S = len(ids)
        full, _ = self.hf.prefill(ids, self.hf.new_cache(), 0, [S], min(keep_from, S - 1))
        if h >= S:  # the full-prompt-hit control: its one row stands for the prompt's last position
            full = full[-1:]
        return judge(restored, split, full, self.tolerance), forward_alone_s


def build(site: EngineSite) -> HFEngine:
    """The `transformers` engine kind: an HFEngine on the runner's pools; the model is built once per run."""
    client = site.client()
    pools = site.pools()
    kv = sim_transfer(site.endpoint, site.layout, pools.pages, site.transfer, site.chunk, site.rank, site.salt,
                      site.name, client)
    if "transformers" not in site.shared:
        site.shared["transformers"] = build_model(site.transformers, site.cfg, site.run_device)
    return HFEngine(kv, site.shared["transformers"], pools, site.prefill, timeout_s=site.timeout_s,
                    before_retrieve=site.before_retrieve)
