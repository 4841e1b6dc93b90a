"""The connector's worker half: `hybridkv.engine.transfer.KVTransfer` moves the bytes, the same code the
CUDA suite covers on the GPU machine. Loads run before the forward (GDN layers never wait per layer), stores
after it; a store's reservation is asked for before the forward too (`prepare_store`, with the blocks vLLM
gave it), so the store after the forward is copy + commit. A store's copy is awaited in `wait_for_save` so
vLLM may free or reuse the blocks at once, its commit to the server goes on in the background.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from hybridkv_kernels import CopyEngine

from hybridkv.engine.client import ServerError
from hybridkv.engine.transfer import KVTransfer, PreparedStore, Streams, TransferConfig, TransferHandle
from hybridkv.engine.vllm.plan import HybridKVMetadata, LoadJob
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import Policy
from hybridkv.protocol import ErrorCode, WireFormat

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerStats:
    """What the worker side moved and what it lost (a lost load is recomputed by vLLM)."""

    loads: int = 0
    load_failures: int = 0
    loaded_bytes: int = 0
    stores: int = 0
    store_failures: int = 0
    stored_bytes: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


@dataclass(slots=True)
class _Ending:
    """Stores of a finished request whose commits are still in flight: its session ends after them."""

    handles: list[TransferHandle] = field(default_factory=list)


class WorkerSide:
    """One vLLM worker rank's transfers."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_rank: int):
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_rank = tp_rank
        self.stats = WorkerStats()
        self.transfer: KVTransfer | None = None
        self._pages: list[list[torch.Tensor]] | None = None
        self._next_try = 0.0
        self._failed_blocks: set[int] = set()
        self._in_flight: dict[str, list[TransferHandle]] = {}
        self._ending: dict[str, _Ending] = {}
        self._prepared: dict[tuple[str, int], PreparedStore] = {}  # (request, start chunk) -> this step's prepare

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Page views of vLLM's cache tensors, checked against the layout, then the server connection."""
        from hybridkv_kernels import page_view

        missing = [n for g in self.layout.groups for n in g.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no cache tensor for layers {missing[:4]}")
        try:
            self._pages = [[page_view(kv_caches[n], g.page_bytes) for n in g.layer_names] for g in self.layout.groups]
        except ValueError as e:
            raise LayoutError(f"vLLM's cache tensors do not hold the layout's pages: {e}") from None
        self._connect()

    def _connect(self) -> bool:
        if self.transfer is not None:
            return True
        if self._pages is None or time.monotonic() < self._next_try:
            return False
        s = self.settings
        # the settings' values were checked against these Literals when the extra config was read
        cfg = TransferConfig(wire_format=cast(WireFormat, s.wire_format), copy_engine=cast(CopyEngine, s.copy_engine),
                             streams=cast(Streams, s.streams), retrieve_policy=cast(Policy, s.retrieve_policy),
                             store_policy="boundary",
                             chunk_tokens=self.chunk_tokens, tp_rank=self.tp_rank, salt=s.salt,
                             timeout_s=s.timeout_s, name=f"vllm-rank{self.tp_rank}")
        try:
            self.transfer = KVTransfer(s.endpoint, self.layout, self._pages, cfg)
        except ServerError as e:
            if e.code == ErrorCode.LAYOUT:
                raise LayoutError(f"cache server {s.endpoint} refused vLLM's layout: {e.message}") from None
            return self._unreachable(e)
        except LayoutError:
            raise
        except Exception as e:  # timeout, connection refused: the server is down
            return self._unreachable(e)
        return True

    def _unreachable(self, e: BaseException) -> bool:
        log.warning("hybridkv: cache server %s unreachable from rank %d (%s); retrying in %.0f s",
                    self.settings.endpoint, self.tp_rank, e, self.settings.retry_s)
        self._next_try = time.monotonic() + self.settings.retry_s
        return False

    def _drop(self, e: BaseException) -> None:
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None
        self._in_flight.clear()
        self._ending.clear()
        self._prepared.clear()
        self._unreachable(e)

    # ---- loads: before the forward ---------------------------------------------------------------

    def start_load(self, meta: HybridKVMetadata) -> None:
        """Reserve this step's stores (their round trips overlap the loads and the forward), then run every
        planned load to completion; a load that fails marks its blocks for recompute."""
        self._prepare_stores(meta)
        for job in meta.loads:
            t0 = time.perf_counter()
            try:
                self._load(job)
            except Exception as e:
                self.stats.load_failures += 1
                self._failed_blocks.update(self.job_blocks(job))
                log.warning("hybridkv: load of %s failed (%s); vLLM recomputes it", job.request_id, e)
                if isinstance(e, (TimeoutError, ConnectionError, ServerError)):
                    self._drop(e)  # the server is gone or refusing: reconnect later
            self.stats.load_s += time.perf_counter() - t0

    def _load(self, job: LoadJob) -> None:
        if not self._connect():
            raise ConnectionError("no connection to the cache server")
        assert self.transfer is not None
        hit = self.transfer.lookup(job.request_id, job.token_ids, skip_tokens=job.skip_tokens)
        if hit.hit_tokens < len(job.token_ids):
            self.transfer.end_session(job.request_id)
            raise LookupError(f"the server holds {hit.hit_tokens} of the {len(job.token_ids)} hit tokens now")
        h = self.transfer.retrieve(hit, job.block_ids).wait(self.settings.timeout_s)
        self.stats.loads += 1
        self.stats.loaded_bytes += h.nbytes

    def job_blocks(self, job: LoadJob) -> set[int]:
        """The blocks a load writes: the hit's attention blocks past the local hit, and the state block."""
        out: set[int] = set()
        first, n = job.skip_tokens // self.chunk_tokens, len(job.token_ids) // self.chunk_tokens
        for g, grp in enumerate(self.layout.groups):
            bpc = self.chunk_tokens // grp.block_tokens
            ids = job.block_ids[g]
            out.update(ids[first * bpc:n * bpc] if grp.kind == "attention" else ids[n * bpc - 1:n * bpc])
        out.discard(0)  # the null block is never loaded into
        return out

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    # ---- stores: prepared before the forward, copied after it ------------------------------------

    def _prepare_stores(self, meta: HybridKVMetadata) -> None:
        """Send each planned store's prepare now; a store whose prepare failed here prepares itself later."""
        self._prepared.clear()  # an earlier step's leftovers: end_session aborts them on the server
        if not meta.stores or self.transfer is None:
            return
        for job in meta.stores:
            try:
                self._prepared[job.request_id, job.start_chunk] = self.transfer.prepare_store(
                    job.request_id, job.token_ids, job.start_chunk, block_ids=job.block_ids)
            except Exception as e:
                log.warning("hybridkv: prepare of the store of %s failed (%s); the store prepares itself",
                            job.request_id, e)

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy every planned store out of vLLM's blocks; commits finish in the background."""
        if not meta.stores or not self._connect():
            return
        assert self.transfer is not None
        t0 = time.perf_counter()
        for job in meta.stores:
            try:
                h = self.transfer.store(job.request_id, job.token_ids, job.block_ids, start_chunk=job.start_chunk,
                                        prepared=self._prepared.pop((job.request_id, job.start_chunk), None))
                h.wait(self.settings.timeout_s)  # pages read: vLLM may reuse the blocks
            except Exception as e:
                self.stats.store_failures += 1
                log.warning("hybridkv: store of %s failed (%s); a later request misses it", job.request_id, e)
                continue
            self.stats.stores += 1
            self.stats.stored_bytes += h.nbytes
            self._in_flight.setdefault(job.request_id, []).append(h)
        self.stats.store_s += time.perf_counter() - t0

    def request_finished(self, finished: set[str]) -> None:
        """End the server sessions of finished requests once their commits are in."""
        for rid in finished:
            self._ending.setdefault(rid, _Ending()).handles.extend(self._in_flight.pop(rid, []))
        for rid in [r for r, e in self._ending.items() if all(h.committed.done() for h in e.handles)]:
            ending = self._ending.pop(rid)
            self.stats.store_failures += sum(1 for h in ending.handles if h.committed.exception() is not None)
            if self.transfer is not None:
                try:
                    self.transfer.end_session(rid)
                except Exception as e:
                    self._drop(e)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait for every in-flight commit, then end the sessions of finished requests whose commits were all
        that kept them open (the harness, tests and shutdown): after this the server holds none of their pins."""
        for hs in [*self._in_flight.values(), *(e.handles for e in self._ending.values())]:
            for h in hs:
                try:
                    h.wait_committed(timeout_s)
                except Exception:
                    pass  # counted when its request ends
        self.request_finished(set())

    def close(self) -> None:
        if self.transfer is not None:
            self.wait_idle(self.settings.timeout_s)
            self.transfer.close()
            self.transfer = None
