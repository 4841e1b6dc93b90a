"""The simulated engine: vLLM-shaped paged pools whose every byte is known, so every load is verified.

An engine owns one page buffer per layer index shared by all groups (`hybridkv_bench.pools.vllm_pools`, vLLM's
hybrid layout) and a block allocator. It runs no model: what a prefill would write into a block is
replaced by deterministic contents derived from (chunk key, group, layer, block within the chunk),
which `PagePattern` expands into a full page with two integer ops per 8 bytes, on GPU or CPU. Because
the content of any page can be recomputed from its key, every page a retrieve writes is compared with
what the page that was stored held; a page that differs or was never written counts its chunk as
corrupt. Destination blocks are zeroed before each retrieve (a pattern page is never all zero), so a
load that silently skips a page cannot pass on stale bytes of an earlier request.

One request (`SimEngine.run`): allocate blocks for the prompt in every group; zero the blocks a hit
could fill; lookup (timed); prepare the store (reserve its slots on the server, as a serving engine does
when it schedules the request: the round trip runs during the load and the prefill); retrieve the hit into
the blocks (timed, submit to `done`); verify; write the pages of the uncached blocks, as a prefill would
(untimed: prefill time is modeled, `prefill_s`); store every full chunk (timed, submit to `committed`: copy
+ commit; the time to `done`, when the engine could reuse the blocks, and the whole span from the prepare
to `committed` are kept beside it); end the session; free the blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from hybridkv.engine.client import CacheClient
from hybridkv.engine.transfer import Hit, KVTransfer, PreparedStore, TransferConfig
from hybridkv.model.layout import ModelLayout
from hybridkv.model.policy import chunk_objects, object_blocks
from hybridkv.wire.protocol import ObjectLoc

from hybridkv_bench.engines.base import CLIENT_TIMEOUT_S, EngineSite, RequestResult, gpu_of
from hybridkv_bench.engines.pools import EnginePools, page_seed


@dataclass(frozen=True, slots=True)
class StoreTiming:
    """One store as a request row records it (all zero when the server already held every object)."""

    start: float          # perf_counter when the store was submitted
    store_s: float        # submitted -> committed
    store_done_s: float   # submitted -> the engine's blocks reusable
    store_copy_s: float   # the copies alone
    bytes_stored: int
    store_span_s: float   # prepare submitted -> committed (the prepare's round trip, hidden or not, included)


def planted_wait(t0: float, fraction: float) -> None:
    """The planted slowdown (BenchOptions.planted_slowdown, a test of `report --compare` only): wait `fraction` of
    the time since `t0` more, so that a timed span ending after it is 1 + fraction as long as it was."""
    if fraction > 0:
        time.sleep(fraction * (time.perf_counter() - t0))


def timed_store(kv: KVTransfer, request_id: str, tokens: np.ndarray, blocks: Sequence[Sequence[int]],
                timeout_s: float, prepared: PreparedStore | None = None, planted: float = 0.0) -> StoreTiming:
    """Store every full chunk of `tokens` from `blocks` (with the reservation `prepared` made earlier, if
    given), wait until committed, end the session; timed (`planted`: see planted_wait)."""
    t0 = time.perf_counter()
    sh = kv.store(request_id, tokens, blocks, prepared=prepared).wait_committed(timeout_s)
    planted_wait(t0, planted)
    t1 = time.perf_counter()
    kv.end_session(request_id)
    if not sh.nbytes:
        return StoreTiming(t0, 0.0, 0.0, 0.0, 0, 0.0)
    store_s = t1 - t0
    return StoreTiming(t0, store_s, sh.t_done - t0 if sh.t_done else store_s, sh.copy_s, sh.nbytes,
                       t1 - (prepared.t_submit if prepared is not None else t0))


class SimEngine:
    """One engine rank: its pools, its KVTransfer, and the request life described in the module doc."""

    def __init__(self, kv: KVTransfer, pools: EnginePools, prefill: Callable[[int, int], float],
                 timeout_s: float = 600.0, before_retrieve: Callable[[Hit], None] | None = None,
                 planted_slowdown: float = 0.0):
        self.kv = kv
        self.pools = pools
        self.layout = pools.layout
        self.chunk_tokens = kv.chunk_tokens
        self.prefill = prefill
        self.timeout_s = timeout_s
        self.before_retrieve = before_retrieve  # a test hook: runs between lookup and retrieve
        self.planted_slowdown = planted_slowdown  # a test of `report --compare`: see planted_wait
        self._cuda = pools.device.type == "cuda"

    @property
    def gpu(self) -> int:
        return gpu_of(self.pools.device)

    def close(self) -> None:
        self.kv.close()

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.pools.device)

    def _bpc(self, g: int) -> int:
        return self.chunk_tokens // self.layout.groups[g].block_tokens

    def _seed(self, keys: list[bytes], tail_key: bytes, g: int, layer: int, position: int) -> int:
        c, j = divmod(position, self._bpc(g))
        return page_seed(keys[c] if c < len(keys) else tail_key, g, layer, j)

    def _zero(self, blocks: list[list[int]], n_chunks: int) -> None:
        for g, ids in enumerate(blocks):
            sel = ids[:n_chunks * self._bpc(g)]
            if sel:
                index = torch.as_tensor(sel, device=self.pools.device)
                for t in self.pools.pages[g]:
                    t.index_fill_(0, index, 0)

    def _prefill_pages(self, blocks: list[list[int]], keys: list[bytes], tail_key: bytes, hit_chunks: int) -> None:
        """Write what a prefill would leave in every block past the hit (the partial last chunk too)."""
        for g, ids in enumerate(blocks):
            start = hit_chunks * self._bpc(g)
            positions = range(start, len(ids))
            if not positions:
                continue
            index = torch.as_tensor(ids[start:], device=self.pools.device)
            for layer, t in enumerate(self.pools.pages[g]):
                pages = self.pools.pattern.pages([self._seed(keys, tail_key, g, layer, p) for p in positions])
                t.index_copy_(0, index, pages)

    def _required(self, n: int) -> set[tuple[int, int]]:
        """(chunk, group) objects a resume at n chunks needs under this engine's retrieve policy."""
        return set(chunk_objects(self.layout, self.kv.config.retrieve_policy, 0, n))

    def verify(self, hit: Hit, blocks: list[list[int]]) -> tuple[int, int]:
        """(verified, corrupt) chunks of the hit: a chunk is corrupt if any page it needs is missing or differs."""
        n = hit.hit_chunks
        bad = {c for c, g in self._required(n) - {(o.chunk, o.group) for o in hit.objects}}
        by_group: dict[int, list[ObjectLoc]] = {}
        for o in hit.objects:
            by_group.setdefault(o.group, []).append(o)
        for g, objs in by_group.items():
            bpc = self._bpc(g)
            every = list(range(len(blocks[g])))
            positions: list[int] = []
            chunks: list[int] = []
            for o in objs:
                within = object_blocks(self.layout, bpc * self.layout.groups[g].block_tokens, g, o.chunk, every)
                positions += within
                chunks += [o.chunk] * len(within)
            index = torch.as_tensor([blocks[g][p] for p in positions], device=self.pools.device)
            for layer, t in enumerate(self.pools.pages[g]):
                expected = self.pools.pattern.pages([self._seed(hit.keys, b"", g, layer, p) for p in positions])
                wrong = (t.index_select(0, index) != expected).any(dim=1).nonzero().flatten().tolist()
                bad.update(chunks[i] for i in wrong)
        return n - len(bad), len(bad)

    def run(self, request_id: str, tokens: np.ndarray, gate: Callable[[str], None] | None = None) -> RequestResult:
        """One request from allocation to free; see the module doc for what is timed. `gate("load")` runs
        just before the lookup and `gate("store")` just before the store (aligning engines' transfers)."""
        kv, layout = self.kv, self.layout
        keys = kv.keys(tokens)
        full = len(keys) * self.chunk_tokens
        tail_key = hashlib.blake2b((keys[-1] if keys else kv.namespace) + np.asarray(tokens[full:], "<u4").tobytes(),
                                   digest_size=16).digest()
        counts = EnginePools.blocks_for(layout, len(tokens))
        blocks = [self.pools.allocator.allocate(n) for n in counts]
        try:
            self._zero(blocks, len(keys))
            self._sync()
            if gate is not None:
                gate("load")
            t0 = time.perf_counter()
            hit = kv.lookup(request_id, tokens)
            lookup_s = time.perf_counter() - t0
            prepared = kv.prepare_store(request_id, tokens, block_ids=blocks)  # as a scheduler would: before
            # the load and the prefill, with the blocks the store will read
            if self.before_retrieve is not None:
                self.before_retrieve(hit)
            load_s, load_copy_s, loaded, verified, corrupt, load_start = 0.0, 0.0, 0, 0, 0, 0.0
            if hit.hit_chunks:
                t0 = load_start = time.perf_counter()
                h = kv.retrieve(hit, blocks).wait(self.timeout_s)
                planted_wait(t0, self.planted_slowdown)
                load_s, load_copy_s, loaded = time.perf_counter() - t0, h.copy_s, h.nbytes
                verified, corrupt = self.verify(hit, blocks)
            self._prefill_pages(blocks, keys, tail_key, hit.hit_chunks)
            prefill_s = self.prefill(len(tokens) - hit.hit_tokens, hit.hit_tokens)
            self._sync()  # the store starts after the "prefill" writes, not racing them
            if gate is not None:
                gate("store")
            stored = timed_store(kv, request_id, tokens, blocks, self.timeout_s, prepared, self.planted_slowdown)
        finally:
            for ids in blocks:
                self.pools.allocator.free(ids)
        return RequestResult(hit_tokens=hit.hit_tokens, lookup_s=lookup_s, load_s=load_s, prefill_s=prefill_s,
                             load_copy_s=load_copy_s, bytes_loaded=loaded, verified_chunks=verified,
                             corrupt_chunks=corrupt, load_start=load_start,
                             store_s=stored.store_s, store_done_s=stored.store_done_s, store_copy_s=stored.store_copy_s,
                             bytes_stored=stored.bytes_stored, store_start=stored.start,
                             store_span_s=stored.store_span_s)


def build(site: EngineSite) -> SimEngine:
    """The `sim` engine kind: a SimEngine on the runner's pools for this engine, over a client of its own."""
    client = site.client()
    pools = site.pools()
    kv = sim_transfer(site.endpoint, site.layout, pools.pages, site.transfer, site.chunk, site.rank, site.salt,
                      site.name, client)
    return SimEngine(kv, pools, site.prefill, timeout_s=site.timeout_s, before_retrieve=site.before_retrieve,
                     planted_slowdown=site.planted_slowdown)


def sim_transfer(endpoint: str, layout: ModelLayout, pages, transfer: TransferConfig, chunk: int, rank: int,
                 salt: str, name: str, client: CacheClient) -> KVTransfer:
    """One rank's KVTransfer for a case's transfer settings, over `client`."""
    cfg = dataclasses.replace(transfer, chunk_tokens=chunk, tp_rank=rank, salt=salt, timeout_s=CLIENT_TIMEOUT_S,
                              name=name)
    return KVTransfer(endpoint, layout, pages, cfg, client=client)
