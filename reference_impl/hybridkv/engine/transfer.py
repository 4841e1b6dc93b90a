"""The engine-side transfer library: moves a hybrid model's paged KV blocks and recurrent states
between the engine's cache (GPU or CPU tensors) and the cache server, for every KV-cache group.

Shaped for a vLLM connector (KVConnectorBase_V1 + SupportsHMA): block ids come as one list per group,
lookups are synchronous, stores and retrieves are asynchronous handles, and `get_finished` reports
requests whose transfers completed. Block j of a group covers tokens [j*B, (j+1)*B) of the request;
for a recurrent group it holds the state after those tokens (vLLM's prefix-caching "align" mode).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
from hybridkv_kernels import CopyEngine, PagedLayers, build_plan, choose_impl, run_plan

from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.engine.handles import Hit, TransferHandle
from hybridkv.engine.wire import WIRE_FORMATS, WIRES, ObjectJob, WireContext
from hybridkv.keys import chunk_keys
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import Policy, check_policy, chunk_objects, object_blocks

__all__ = ["COPY_ENGINES", "STREAM_MODES", "WIRE_FORMATS", "Hit", "KVTransfer", "TransferConfig", "TransferHandle"]

Streams = Literal["single", "per_group"]
STREAM_MODES: tuple[Streams, ...] = get_args(Streams)
COPY_ENGINES: tuple[CopyEngine, ...] = get_args(CopyEngine)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How an engine moves bytes; validated at construction."""

    wire_format: P.WireFormat = "shm"
    # auto: DMA for pages of 1 MiB and more, the one-launch kernel below (as measured on the H200);
    # kernel / dma / triton / torch pin a choice (see hybridkv_kernels.dispatch)
    copy_engine: CopyEngine = "auto"
    streams: Streams = "single"        # single: every group on one stream; per_group: a stream per group (the seed's)
    # boundary: recurrent state only at the last hit chunk; all: every chunk (the seed's)
    retrieve_policy: Policy = "boundary"
    store_policy: Policy = "boundary"  # boundary: recurrent state only at the last stored chunk; all: every chunk
    chunk_tokens: int = 0              # 0: the layout's unified block size
    tp_rank: int = 0
    salt: str = ""
    timeout_s: float = 60.0
    name: str = ""

    def __post_init__(self) -> None:
        for fld, allowed in (("wire_format", WIRE_FORMATS), ("copy_engine", COPY_ENGINES),
                             ("streams", STREAM_MODES)):
            if getattr(self, fld) not in allowed:
                raise ValueError(f"{fld} must be one of {allowed}, got {getattr(self, fld)!r}")
        check_policy(self.retrieve_policy)
        check_policy(self.store_policy)
        if self.chunk_tokens < 0 or self.timeout_s <= 0:
            raise ValueError(f"chunk_tokens must be >= 0 and timeout_s > 0, got {self.chunk_tokens}, {self.timeout_s}")


Direction = Literal["gather", "scatter"]
Kind = Literal["store", "load"]
# handle, chunk keys, (chunk, group) objects, block ids per group, the event the copies wait for
_StoreItem = tuple[TransferHandle, list[bytes], list[tuple[int, int]], Sequence[Sequence[int]],
                   "torch.cuda.Event | None"]
_LoadItem = tuple[TransferHandle, Hit, list[ObjectJob]]


class KVTransfer:
    """One engine rank's connection to the cache server, with its paged caches registered."""

    def __init__(self, endpoint: str, layout: ModelLayout,
                 pages: Sequence[Sequence[torch.Tensor]] | Mapping[str, torch.Tensor],
                 config: TransferConfig | None = None, client: CacheClient | None = None):
        self.layout = layout
        self.config = config = config or TransferConfig()
        self.groups = self._paged_groups(layout, pages)
        self.device = self.groups[0].device
        self.chunk_tokens = config.chunk_tokens or layout.default_chunk_tokens()
        layout.check_chunk_tokens(self.chunk_tokens)
        # every group's pages have one size in vLLM's hybrid layout; the smallest decides otherwise
        self.impl = choose_impl(config.copy_engine, min(g.page_bytes for g in self.groups), self.device)
        self._own_client = client is None
        self.client = client or CacheClient(endpoint, timeout_s=config.timeout_s)
        reg, _ = self.client.call(P.Register(layout=layout, chunk_tokens=self.chunk_tokens, tp_rank=config.tp_rank,
                                             salt=config.salt, name=config.name))
        self.engine_id, self.namespace = reg.engine, reg.namespace
        self.object_bytes = reg.object_bytes
        expect = [layout.object_bytes(g, self.chunk_tokens) for g in range(len(layout.groups))]
        if self.object_bytes != expect:
            raise LayoutError(f"server sizes objects {self.object_bytes}, this engine {expect}")
        self.client.keepalive(self.engine_id, reg.heartbeat_s)
        self.wire = WIRES[config.wire_format](WireContext(
            client=self.client, engine_id=self.engine_id, device=self.device, groups=self.groups,
            dtypes=[g.dtype for g in layout.groups], arena_path=reg.arena_path, arena_bytes=reg.arena_bytes))
        cuda = self.device.type == "cuda"
        n_streams = len(self.groups) if config.streams == "per_group" else 1
        self._streams: dict[Kind, list[torch.cuda.Stream | None]] = {
            k: [torch.cuda.Stream(self.device) for _ in range(n_streams)] if cuda else [None]
            for k in ("store", "load")}
        self._finished: dict[Kind, set[str]] = {"store": set(), "load": set()}
        self._finished_lock = threading.Lock()
        self._store_q: queue.SimpleQueue[_StoreItem | None] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[_LoadItem | None] = queue.SimpleQueue()
        # Stores and loads on their own threads: a store parked behind L2 never delays a retrieve.
        self._workers = [threading.Thread(target=self._store_worker, name="hkv-store", daemon=True),
                         threading.Thread(target=self._load_worker, name="hkv-load", daemon=True)]
        for w in self._workers:
            w.start()

    # ---- construction helpers ---------------------------------------------------------------------

    @staticmethod
    def _paged_groups(layout: ModelLayout, pages) -> list[PagedLayers]:
        """Page views per group, checked against the layout (layer count, names, page size)."""
        if isinstance(pages, Mapping):
            missing = [n for g in layout.groups for n in g.layer_names if n not in pages]
            if missing:
                raise LayoutError(f"no cache tensor for layers {missing[:4]}{'...' if len(missing) > 4 else ''}")
            per_group = [[pages[n] for n in g.layer_names] for g in layout.groups]
        else:
            per_group = [list(p) for p in pages]
        if len(per_group) != len(layout.groups):
            raise LayoutError(f"layout has {len(layout.groups)} groups, pages were given for {len(per_group)}")
        out = []
        for i, (g, views) in enumerate(zip(layout.groups, per_group, strict=True)):
            if len(views) != g.num_layers:
                raise LayoutError(f"group {i} has {g.num_layers} layers, {len(views)} page views were given")
            paged = PagedLayers.from_views(views)
            if paged.page_bytes != g.page_bytes:
                raise LayoutError(f"group {i}: pages of {paged.page_bytes} B, the layout says {g.page_bytes} B")
            out.append(paged)
        if len({p.device for p in out}) != 1:
            raise LayoutError("every group's pages must be on one device")
        return out

    # ---- public API -------------------------------------------------------------------------------

    def keys(self, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chunk keys of every full chunk of `token_ids` in this engine's namespace."""
        return chunk_keys(self.namespace, token_ids, self.chunk_tokens)

    def lookup(self, request_id: str, token_ids: Sequence[int] | np.ndarray, skip_tokens: int = 0) -> Hit:
        """The longest resumable prefix; its objects are pinned (and in L1) until retrieved or end_session."""
        keys = self.keys(token_ids)
        if not keys:
            return Hit(request_id, keys, 0, self.chunk_tokens, 0, [])
        r, _ = self.client.call(P.Lookup(engine=self.engine_id, request=request_id, keys=keys,
                                         policy=self.config.retrieve_policy,
                                         skip_chunks=skip_tokens // self.chunk_tokens))
        return Hit(request_id, keys, r.hit_chunks, self.chunk_tokens, r.lease, r.objects)

    def prefetch(self, token_ids: Sequence[int] | np.ndarray) -> Future[P.Prefetching]:
        """Ask the server to bring the cached prefix of `token_ids` from L2 into L1 ahead of the lookup.

        Returns at once: the future holds the server's `Prefetching` answer (sent before any L2 read
        ends), or its error; nothing is pinned, and the caller need never wait for it."""
        out: Future[P.Prefetching] = Future()
        keys = self.keys(token_ids)
        if not keys:
            out.set_result(P.Prefetching(hit_chunks=0, in_l1=0, loading=0, started=0, waiting=0, refused=0))
            return out
        sent = self.client.submit(P.Prefetch(engine=self.engine_id, keys=keys, policy=self.config.retrieve_policy))

        def answered(f: Future) -> None:
            e = f.exception()
            out.set_exception(e) if e is not None else out.set_result(f.result()[0])

        sent.add_done_callback(answered)
        return out

    def retrieve(self, hit: Hit, block_ids: Sequence[Sequence[int]]) -> TransferHandle:
        """Load a hit's objects into the engine's blocks (one list per group), asynchronously."""
        h = TransferHandle("load", hit.request_id)
        jobs = self._object_blocks(hit.objects, block_ids)  # validate in the caller's thread
        if not hit.objects:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            h.done.set_result(h)
            h.committed.set_result(h)
            return h
        self._load_q.put((h, hit, jobs))
        return h

    def store(self, request_id: str, token_ids: Sequence[int] | np.ndarray,
              block_ids: Sequence[Sequence[int]], start_chunk: int = 0) -> TransferHandle:
        """Store every full chunk of `token_ids` from the engine's blocks, asynchronously and delta-aware.

        Copies start after the work already queued on the caller's current CUDA stream. `done` says the
        engine may reuse the blocks; `committed` that the server made the objects visible.
        """
        keys = self.keys(token_ids)
        objects = chunk_objects(self.layout, self.config.store_policy, start_chunk, len(keys))
        h = TransferHandle("store", request_id)
        locs = [P.ObjectLoc(c, g, 0, self.object_bytes[g]) for c, g in objects]
        self._object_blocks(locs, block_ids)  # validate block lists now, in the caller's thread
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if not objects:
            h.done.set_result(h)
            h.committed.set_result(h)
            return h
        self._store_q.put((h, keys, objects, block_ids, ready))
        return h

    def end_session(self, request_id: str) -> int:
        """The request is finished: the server drops its pins and open reservations."""
        done, _ = self.client.call(P.EndSession(engine=self.engine_id, request=request_id))
        return done.count

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose stores / retrieves completed since the last call (vLLM's get_finished)."""
        with self._finished_lock:
            out = (self._finished["store"], self._finished["load"])
            self._finished = {"store": set(), "load": set()}
        return out

    def close(self) -> None:
        """Finish queued transfers, unregister, and release the arena mapping and the connection."""
        self._store_q.put(None)
        self._load_q.put(None)
        for w in self._workers:
            w.join(timeout=self.config.timeout_s)
        try:
            self.client.forget(self.engine_id)
            self.client.call(P.Unregister(engine=self.engine_id), timeout=5)
        except Exception:
            pass  # the server may be gone already; it reclaims silent engines anyway
        if self._own_client:
            self.client.close()
        self.wire.close()

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- workers ------------------------------------------------------------------------------------

    def _store_worker(self) -> None:
        while (item := self._store_q.get()) is not None:
            self._guarded(item[0], self._do_store, *item)

    def _load_worker(self) -> None:
        while (item := self._load_q.get()) is not None:
            self._guarded(item[0], self._do_load, *item)

    @staticmethod
    def _guarded(h: TransferHandle, fn, *args) -> None:
        """Run one transfer; a failure is delivered through the handle and the worker keeps going."""
        try:
            fn(*args)
        except BaseException as e:
            for f in (h.done, h.committed):
                if not f.done():
                    f.set_exception(e)

    def _resolve_done(self, h: TransferHandle) -> None:
        """The engine's pages are free: report the request to get_finished, then wake waiters."""
        with self._finished_lock:
            self._finished[h.kind].add(h.request_id)
        h.done.set_result(h)

    def _object_blocks(self, objects: Sequence[P.ObjectLoc], block_ids: Sequence[Sequence[int]]) -> list[ObjectJob]:
        """For each object, its group's block ids: a chunk's blocks (attention) or its last block (state)."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"block ids for {len(block_ids)} groups given; the layout has {len(self.groups)}")
        return [(o, np.asarray(object_blocks(self.layout, self.chunk_tokens, o.group, o.chunk, block_ids[o.group]),
                               dtype=np.int64)) for o in objects]

    def _copier(self, h: TransferHandle, direction: Direction, ready: torch.cuda.Event | None = None):
        """The page-copy step a wire strategy runs: timed into `h`, grouped per stream, waited for here."""
        streams = self._streams[h.kind]

        def copy(items: list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]]) -> None:
            if not h.t_copy_start:
                h.t_copy_start = time.perf_counter()
            by_stream: dict[int, list] = {}
            for o, ids, host in items:
                by_stream.setdefault(o.group % len(streams), []).append((self.groups[o.group], ids, host))
            events = []
            for i, transfers in by_stream.items():
                plan = build_plan(direction, transfers)
                s = streams[i]
                if s is not None and ready is not None:
                    s.wait_event(ready)
                run_plan(plan, self.impl, s)
                if s is not None:
                    ev = torch.cuda.Event()
                    ev.record(s)
                    events.append((ev, plan))  # the plan keeps its tensors alive until the copy ends
            for ev, _ in events:
                ev.synchronize()
            h.t_done = time.perf_counter()

        return copy

    def _do_store(self, h: TransferHandle, keys: list[bytes], objects: list[tuple[int, int]],
                  block_ids: Sequence[Sequence[int]], ready: torch.cuda.Event | None) -> None:
        prep, _ = self.client.call(P.PrepareStore(engine=self.engine_id, request=h.request_id, keys=keys,
                                                  objects=objects))
        h.skipped, h.refused = len(prep.present), len(prep.refused)
        if not prep.slots:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            self._resolve_done(h)
            h.committed.set_result(h)
            return

        def pages_read() -> None:
            h.nbytes, h.objects = sum(s.length for s in prep.slots), len(prep.slots)
            self._resolve_done(h)

        try:
            jobs = self._object_blocks(prep.slots, block_ids)
            self.wire.store(h, prep.reservation, jobs, self._copier(h, "gather", ready), ready, pages_read)
        except BaseException:
            try:  # nothing half-written may stay reserved on the server
                self.client.call(P.AbortStore(engine=self.engine_id, reservation=prep.reservation), timeout=5)
            except Exception:
                pass
            raise
        h.t_committed = time.perf_counter()
        h.committed.set_result(h)

    def _do_load(self, h: TransferHandle, hit: Hit, jobs: list[ObjectJob]) -> None:
        try:
            h.t_copy_start = time.perf_counter()  # for raw and legacy formats: fetch, decode and copy
            self.wire.load(h, hit, jobs, self._copier(h, "scatter"))
            h.t_done = h.t_committed = time.perf_counter()
            h.nbytes, h.objects = hit.nbytes, len(hit.objects)
        except BaseException:
            self._release(hit.lease)
            raise
        self._resolve_done(h)
        h.committed.set_result(h)
        # The pages are written and every copy has finished reading the slots: the engine need not wait
        # for the release round trip (one fixed cost fewer per retrieve).
        self._release(hit.lease)

    def _release(self, lease: int) -> None:
        try:
            self.client.call(P.Release(engine=self.engine_id, lease=lease))
        except Exception:
            pass  # end_session or the server's reclaim drops the pins anyway
