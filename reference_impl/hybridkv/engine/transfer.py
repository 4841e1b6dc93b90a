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
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from hybridkv_kernels import CopyEngine, build_plan, choose_impl, plan_pages, run_plan

from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.engine.handles import Hit, PreparedStore, TransferHandle
from hybridkv.engine.paged import paged_groups, same_blocks
from hybridkv.engine.wire import WIRE_FORMATS, WIRES, ObjectJob, WireContext
from hybridkv.keys import chunk_keys
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import Policy, check_policy, chunk_objects, object_blocks

__all__ = ["COPY_ENGINES", "STREAM_MODES", "WIRE_FORMATS", "Hit", "KVTransfer", "PreparedStore", "TransferConfig",
           "TransferHandle"]

Streams = Literal["single", "per_group"]
STREAM_MODES: tuple[Streams, ...] = get_args(Streams)
COPY_ENGINES: tuple[CopyEngine, ...] = get_args(CopyEngine)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How an engine moves bytes; validated at construction."""

    wire_format: P.WireFormat = "shm"
    # auto: DMA (one batched driver call per plan where the driver has it) for pages of 400 KB and more
    # (1 MiB without batching), the one-launch kernel below (as measured on the H200);
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
# handle, its prepare, every asked-for object's blocks, the plans' engine halves if made, the event the copies wait for
_StoreItem = tuple[TransferHandle, PreparedStore, list[ObjectJob], dict | None, "torch.cuda.Event | None"]
_LoadItem = tuple[TransferHandle, Hit, list[ObjectJob]]


class KVTransfer:
    """One engine rank's connection to the cache server, with its paged caches registered."""

    def __init__(self, endpoint: str, layout: ModelLayout,
                 pages: Sequence[Sequence[torch.Tensor]] | Mapping[str, torch.Tensor],
                 config: TransferConfig | None = None, client: CacheClient | None = None):
        self.layout = layout
        self.config = config = config or TransferConfig()
        self.groups = paged_groups(layout, pages)
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
        self._commits: set[Future] = set()  # stores' commits in flight (close waits for them)
        self._store_q: queue.SimpleQueue[_StoreItem | None] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[_LoadItem | None] = queue.SimpleQueue()
        # Stores and loads on their own threads: a store parked behind L2 never delays a retrieve.
        self._workers = [threading.Thread(target=self._store_worker, name="hkv-store", daemon=True),
                         threading.Thread(target=self._load_worker, name="hkv-load", daemon=True)]
        for w in self._workers:
            w.start()

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

    def prepare_store(self, request_id: str, token_ids: Sequence[int] | np.ndarray, start_chunk: int = 0,
                      block_ids: Sequence[Sequence[int]] | None = None) -> PreparedStore:
        """Reserve the server's slots for a store ahead of it (e.g. when the request is scheduled, before its
        prefill), so that the store itself is copy + commit. Returns at once; the reply comes on the
        client's I/O thread. Delta-aware: objects the server holds when it answers get no slot. With the
        blocks the store will read (`block_ids`), they are validated now and the copy plan's engine half is
        built while the prepare is in flight."""
        keys = self.keys(token_ids)
        objects = chunk_objects(self.layout, self.config.store_policy, start_chunk, len(keys))
        jobs = self._all_blocks(objects, block_ids) if block_ids is not None else None  # before reserving
        t0 = time.perf_counter()
        if objects:
            reply = self.client.submit(P.PrepareStore(engine=self.engine_id, request=request_id, keys=keys,
                                                      objects=objects))
        else:
            reply = Future()
            reply.set_result((P.Prepared(reservation=0, slots=[], present=[], refused=[]), []))
        prep = PreparedStore(request_id, keys, start_chunk, objects, reply, t0)
        if jobs:
            try:
                prep.pages = self._plan_pages("gather", jobs)
            except BaseException:
                reply.add_done_callback(self._abort_prepared)
                raise
            prep.block_ids, prep.jobs = block_ids, jobs
        return prep

    def _plan_pages(self, direction: Direction, jobs: list[ObjectJob]) -> dict[int, tuple[Any, list[tuple[int, int]]]]:
        """Per stream: the engine half of the copy plan over `jobs`' blocks, and the (chunk, group) it lists."""
        n = len(self._streams["store" if direction == "gather" else "load"])
        by_stream: dict[int, list[ObjectJob]] = {}
        for o, ids in jobs:
            by_stream.setdefault(o.group % n, []).append((o, ids))
        return {i: (plan_pages(direction, [(self.groups[o.group], ids) for o, ids in js]),
                    [(o.chunk, o.group) for o, _ in js]) for i, js in by_stream.items()}

    def store(self, request_id: str, token_ids: Sequence[int] | np.ndarray,
              block_ids: Sequence[Sequence[int]], start_chunk: int = 0,
              prepared: PreparedStore | None = None) -> TransferHandle:
        """Store every full chunk of `token_ids` from the engine's blocks, asynchronously and delta-aware.

        With `prepared` (from `prepare_store` of the same request, tokens and start chunk) the slots are
        already reserved and the store is copy + commit; without, the prepare is sent now. Copies start
        after the work already queued on the caller's current CUDA stream. `done` says the engine may
        reuse the blocks; `committed` that the server made the objects visible.
        """
        h = TransferHandle("store", request_id)
        pages = None
        if prepared is None:
            objects = chunk_objects(self.layout, self.config.store_policy, start_chunk,
                                    len(token_ids) // self.chunk_tokens)
            jobs = self._all_blocks(objects, block_ids)  # bad block ids reserve nothing
            prepared = self.prepare_store(request_id, token_ids, start_chunk)
            prepared.t_submit = h.t_submit  # one span: the store's own prepare is part of it
        else:
            self._check_prepared(prepared, request_id, token_ids, start_chunk)
            prepared.used = True  # before anything can fail: an aborted reservation is never used again
            objects = prepared.objects
            try:
                if prepared.jobs is not None and same_blocks(prepared.block_ids, block_ids):
                    jobs, pages = prepared.jobs, prepared.pages
                else:
                    jobs = self._all_blocks(objects, block_ids)
            except BaseException:
                prepared.reply.add_done_callback(self._abort_prepared)
                raise
        h.t_prepare = prepared.t_submit
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if not objects:
            h.done.set_result(h)
            h.committed.set_result(h)
            return h
        self._store_q.put((h, prepared, jobs, pages, ready))
        return h

    def _check_prepared(self, prep: PreparedStore, request_id: str, token_ids: Sequence[int] | np.ndarray,
                        start_chunk: int) -> None:
        """A prepared store must be this request's, unused, and of the same chunks (keys are not hashed again)."""
        if prep.used:
            raise ValueError(f"the prepared store of {prep.request_id!r} was used by a store already")
        chunks = len(token_ids) // self.chunk_tokens
        if (prep.request_id, len(prep.keys), prep.start_chunk) != (request_id, chunks, start_chunk):
            raise ValueError(f"prepared store of {prep.request_id!r} ({len(prep.keys)} chunks from chunk "
                             f"{prep.start_chunk}) does not match store of {request_id!r} ({chunks} chunks from "
                             f"chunk {start_chunk})")

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
        with self._finished_lock:
            commits = list(self._commits)
        futures.wait(commits, timeout=self.config.timeout_s + 5)  # commits resolve on the client's thread
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

    def _all_blocks(self, objects: list[tuple[int, int]], block_ids: Sequence[Sequence[int]]) -> list[ObjectJob]:
        """Every (chunk, group) object's blocks, validated in the caller's thread before anything is reserved."""
        return self._object_blocks([P.ObjectLoc(c, g, 0, self.object_bytes[g]) for c, g in objects], block_ids)

    def _object_blocks(self, objects: Sequence[P.ObjectLoc], block_ids: Sequence[Sequence[int]]) -> list[ObjectJob]:
        """For each object, its group's block ids: a chunk's blocks (attention) or its last block (state)."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"block ids for {len(block_ids)} groups given; the layout has {len(self.groups)}")
        return [(o, np.asarray(object_blocks(self.layout, self.chunk_tokens, o.group, o.chunk, block_ids[o.group]),
                               dtype=np.int64)) for o in objects]

    def _copier(self, h: TransferHandle, direction: Direction, ready: torch.cuda.Event | None = None,
                pages: dict | None = None):
        """The page-copy step a wire strategy runs: timed into `h`, grouped per stream, waited for here.
        With `pages` (from `_plan_pages`) the plans' engine halves exist: only the objects are bound."""
        streams = self._streams[h.kind]

        def plans(items: list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]]) -> list:
            if pages is not None:
                hosts = {(o.chunk, o.group): host for o, _, host in items}
                return [(i, half.bind([hosts.get(k) for k in order])) for i, (half, order) in pages.items()
                        if any(k in hosts for k in order)]
            by_stream: dict[int, list] = {}
            for o, ids, host in items:
                by_stream.setdefault(o.group % len(streams), []).append((self.groups[o.group], ids, host))
            return [(i, build_plan(direction, transfers)) for i, transfers in by_stream.items()]

        def copy(items: list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]]) -> None:
            if not h.t_copy_start:
                h.t_copy_start = time.perf_counter()
            events = []
            for i, plan in plans(items):
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

    def _do_store(self, h: TransferHandle, prep: PreparedStore, jobs: list[ObjectJob], pages: dict | None,
                  ready: torch.cuda.Event | None) -> None:
        reply = prep.wait(self.config.timeout_s + 5)
        h.skipped, h.refused = len(reply.present), len(reply.refused)
        if not reply.slots:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            self._resolve_done(h)
            h.committed.set_result(h)
            return

        def pages_read() -> None:
            h.nbytes, h.objects = sum(s.length for s in reply.slots), len(reply.slots)
            self._resolve_done(h)

        try:
            by_object = {(o.chunk, o.group): ids for o, ids in jobs}
            slot_jobs = [(s, by_object[s.chunk, s.group]) for s in reply.slots]
            commit = self.wire.store(h, reply.reservation, slot_jobs, self._copier(h, "gather", ready, pages), ready,
                                     pages_read)
        except BaseException:
            self._abort(reply.reservation)
            raise
        # Resolved on the client's I/O thread as the reply arrives: no hand-off back to this worker, which
        # goes on with the next store meanwhile.
        with self._finished_lock:
            self._commits.add(commit)
        commit.add_done_callback(lambda f: self._committed(h, reply.reservation, f))

    def _committed(self, h: TransferHandle, reservation: int, commit: Future) -> None:
        with self._finished_lock:
            self._commits.discard(commit)
        exc = commit.exception()
        if exc is None:
            h.t_committed = time.perf_counter()
            h.committed.set_result(h)
            return
        self._abort(reservation, wait=False)  # on the I/O thread: never wait for a reply here
        for f in (h.done, h.committed):
            if not f.done():
                f.set_exception(exc)

    def _abort_prepared(self, reply: Future) -> None:
        """A prepared store that will never run: free its slots once the server's answer is in."""
        if reply.exception() is None:
            self._abort(reply.result()[0].reservation, wait=False)

    def _abort(self, reservation: int, wait: bool = True) -> None:
        """Nothing half-written may stay reserved on the server."""
        if not reservation:
            return
        try:
            fut = self.client.submit(P.AbortStore(engine=self.engine_id, reservation=reservation))
            if wait:
                fut.result(timeout=5)
        except Exception:
            pass  # end_session or the server's reclaim of a silent engine frees it anyway

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
