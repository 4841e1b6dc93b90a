"""KV cache events for vLLM's publisher (`--kv-events-config`): what this deployment holds in hybridkv, in the
event structs vLLM's own prefix cache publishes, so a KV-aware router (llm-d, Dynamo) that indexes vLLM's block
hashes counts hybridkv's chunks as this pod's.

- BlockStored (medium "CPU": the server's memory) once a store is committed on every tensor-parallel rank: one
  event per KV-cache group, vLLM's own hashes of the chunk's blocks at that group's block size (group_idx as in
  vLLM's KVCacheConfig). Attention groups name every block of the stored chunks; a Mamba/GDN group names the one
  block whose state was stored (the store's last), as vLLM's align-mode prefix cache does. A store the server
  refused part of, or one that failed on any rank, is not announced: a missing event costs a routing miss, a
  wrong one a wrong route.
- BlockRemoved when a lookup finds an announced store no longer servable (the server evicted part of it):
  the server sends no eviction notices, so this is what lookups show, no more.
- AllBlocksCleared when vLLM's reset of the external cache (`reset_cache`) was confirmed by the server.

The workers report which stores ended and how (`HybridKVEvents`, vLLM's worker-to-scheduler event container);
the scheduler side, which planned each store from the live Request, holds its events until every rank reported.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from hybridkv.model.layout import ModelLayout

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vllm.v1.request import Request

    from hybridkv.engine.handles import TransferHandle
    from hybridkv.engine.vllm.plan import StoreJob

# (tp rank, request id, first chunk, end chunk, committed in full): one store as a worker saw it end
StoreReport = tuple[int, str, int, int, bool]

PENDING_S = 600.0  # a store whose reports never all came (a rank's connection dropped) is forgotten then
MAX_PENDING = 4096  # stores awaiting their ranks' reports; the oldest is forgotten past this
MAX_ANNOUNCED = 65536  # stores announced and watched for eviction; the oldest is no longer watched past this


class HybridKVEvents(KVConnectorKVEvents):
    """vLLM's container from the workers to the scheduler side (`KVConnectorOutput.kv_cache_events`, summed over
    tensor-parallel workers by vLLM's output aggregator): the store reports of one step. It carries reports, not
    KV events: the scheduler side turns them into events (`KVEventTracker.reported`)."""

    def __init__(self, reports: list[StoreReport] | None = None):
        self.reports: list[StoreReport] = list(reports or [])
        self.workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.reports.extend(events)

    def aggregate(self) -> HybridKVEvents:
        return self  # the scheduler side counts ranks per store itself

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports.clear()


@dataclass(slots=True)
class _Pending:
    """A planned store's events, waiting for every rank's report."""

    stored: list[BlockStored]
    removed: list[BlockRemoved]  # what to announce if a lookup later finds it gone
    boundary: bytes  # vLLM's hash of the store's last block: the key its eviction is watched under
    since: float
    ranks: set[int]
    ok: bool = True


class KVEventTracker:
    """The scheduler side's KV events: stores snapshotted when planned (while the Request is at hand),
    announced once every rank committed them, watched for eviction by later lookups; `take` drains them."""

    def __init__(self, layout: ModelLayout, chunk_tokens: int, hash_block_size: int, tp_size: int,
                 group_kinds: list[str | None] | None = None, medium: str = MEDIUM_CPU):
        if chunk_tokens % hash_block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of vLLM's hash block {hash_block_size}")
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.hash_block_size = hash_block_size
        self.tp_size = tp_size
        self.medium = medium
        # vLLM's KVCacheSpecKind of each group, as its own BlockStored events name them
        self.group_kinds = group_kinds or [
            "full_attention" if g.kind == "attention" else "mamba" for g in layout.groups]
        self._pending: OrderedDict[tuple[str, int, int], _Pending] = OrderedDict()
        self._announced: OrderedDict[bytes, list[BlockRemoved]] = OrderedDict()
        self._out: deque[KVCacheEvent] = deque()

    # ---- the scheduler's calls -----------------------------------------------------------------

    def planned(self, req: Request, start_chunk: int, end_chunk: int) -> None:
        """A store of chunks start..end-1 of `req` is planned: snapshot its events now."""
        self._expire()
        stored, removed = self._events(req, start_chunk, end_chunk)
        boundary = bytes(req.block_hashes[end_chunk * self.chunk_tokens // self.hash_block_size - 1])
        self._pending[req.request_id, start_chunk, end_chunk] = _Pending(stored, removed, boundary,
                                                                          time.monotonic(), set())
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def reported(self, reports: list[StoreReport]) -> None:
        """Workers' reports of ended stores: a store committed on every rank is announced."""
        for rank, rid, start, end, ok in reports:
            p = self._pending.get((rid, start, end))
            if p is None:
                continue  # planned before a reset, or forgotten
            p.ranks.add(rank)
            p.ok &= ok
            if len(p.ranks) < self.tp_size:
                continue
            del self._pending[rid, start, end]
            if p.ok:
                self._out.extend(p.stored)
                self._announced[p.boundary] = p.removed
                self._announced.move_to_end(p.boundary)
                while len(self._announced) > MAX_ANNOUNCED:
                    self._announced.popitem(last=False)

    def observed_hit(self, req: Request, limit_chunks: int, hit_chunks: int) -> None:
        """A lookup of `req`'s first `limit_chunks` chunks found `hit_chunks` servable on every rank: an announced
        store ending at a longer boundary within the limit is no longer servable (the hit rule takes the longest
        prefix whose attention and end state are all held): announce its removal."""
        if not self._announced:
            return
        per = self.chunk_tokens // self.hash_block_size
        hashes = req.block_hashes
        for b in range(hit_chunks + 1, min(limit_chunks, len(hashes) // per) + 1):
            gone = self._announced.pop(bytes(hashes[b * per - 1]), None)
            if gone is not None:
                self._out.extend(gone)

    def cleared(self) -> None:
        """The server dropped every object of this deployment (vLLM's reset of the external cache): stores
        planned before it may have landed before the drop, so they are not announced."""
        self._pending.clear()
        self._announced.clear()
        self._out.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        out = list(self._out)
        self._out.clear()
        return out

    # ---- event payloads ------------------------------------------------------------------------

    def _expire(self) -> None:
        too_old = time.monotonic() - PENDING_S
        while self._pending and next(iter(self._pending.values())).since < too_old:
            self._pending.popitem(last=False)

    def _events(self, req: Request, start_chunk: int, end_chunk: int) -> tuple[list[BlockStored],
                                                                              list[BlockRemoved]]:
        """BlockStored per group for chunks start..end-1 (attention: every block; Mamba/GDN: the last block,
        whose state the store holds; sliding window: the last chunk's stored tail, the blocks a resume at its end
        reads), and the BlockRemoved that would undo them."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

        stored: list[BlockStored] = []
        removed: list[BlockRemoved] = []
        lora = req.lora_request
        for g, grp in enumerate(self.layout.groups):
            bs = grp.block_tokens
            hashes = resolve_block_hashes(req.block_hashes, self.hash_block_size, bs)
            bpc = self.chunk_tokens // bs
            last = end_chunk * bpc
            first = (start_chunk * bpc if grp.kind == "attention" else
                     last - grp.tail_blocks(self.chunk_tokens) if grp.kind == "sliding" else last - 1)
            block_hashes = [maybe_convert_block_hash(hashes[j]) for j in range(first, last)]
            stored.append(BlockStored(
                block_hashes=block_hashes,
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                token_ids=list(req.all_token_ids[first * bs:last * bs]), block_size=bs,
                lora_id=lora.adapter_id if lora else None, medium=self.medium,
                lora_name=lora.name if lora else None, extra_keys=self._extra_keys(req, first, last, bs),
                group_idx=g, kv_cache_spec_kind=self.group_kinds[g], session_id=getattr(req, "session_id", None)))
            removed.append(BlockRemoved(block_hashes=block_hashes, medium=self.medium, group_idx=g))
        return stored, removed

    @staticmethod
    def _extra_keys(req: Request, first: int, last: int, bs: int) -> list[tuple[Any, ...] | None] | None:
        """Per block, what else vLLM's hash of it covers (LoRA name, images, cache salt, prompt embeddings), in
        the untagged form vLLM's own events publish."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        keys, mm = [], 0
        for j in range(first, last):
            k, mm = generate_block_hash_extra_keys(req, j * bs, (j + 1) * bs, mm)
            keys.append(k)
        return to_event_extra_keys(keys) if any(k is not None for k in keys) else None


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (`--kv-events-config '{"enable_kv_cache_events": true, ...}'`)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


class StoreReports:
    """A worker rank's record of how its stores ended, taken by the connector each step for the scheduler side
    (appended on the client's I/O thread when a commit's answer comes)."""

    def __init__(self, tp_rank: int, chunk_tokens: int):
        self.tp_rank, self.chunk_tokens = tp_rank, chunk_tokens
        self._reports: deque[StoreReport] = deque()

    def report(self, job: StoreJob, ok: bool) -> None:
        self._reports.append((self.tp_rank, job.request_id, job.start_chunk, len(job.token_ids) // self.chunk_tokens,
                              ok))

    def report_commit(self, job: StoreJob, h: TransferHandle, committed: Future) -> None:
        """A store's commit answered: held in full only when it committed and the server refused none of it."""
        self.report(job, committed.exception() is None and not h.refused)

    def take(self) -> list[StoreReport]:
        out = []
        while self._reports:
            out.append(self._reports.popleft())
        return out
