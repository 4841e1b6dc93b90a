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
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Literal

import numpy as np
import torch
from hybridkv_kernels import choose_impl

from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.engine.config import COPY_ENGINES, STREAM_MODES, Streams, TransferConfig
from hybridkv.engine.copies import Issued, PageCopies
from hybridkv.engine.handles import Hit, PreparedStore, TransferHandle
from hybridkv.engine.paged import paged_groups, same_blocks
from hybridkv.engine.wire import WIRE_FORMATS, WIRES, ObjectJob, WireContext
from hybridkv.keys import chunk_keys
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import chunk_objects, object_blocks

__all__ = ["COPY_ENGINES", "STREAM_MODES", "WIRE_FORMATS", "Hit", "KVTransfer", "PreparedStore", "Streams",
           "TransferConfig", "TransferHandle"]

Kind = Literal["store", "load"]
# A transfer's handle and the worker's step for it: the whole transfer, or the end of one whose copies its
# caller queued already (a direct wire on CUDA): wait for them, then commit / release.
_Item = tuple[TransferHandle, Callable[..., None], tuple]


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
        self.copies = PageCopies(self.groups, self.impl, len(self.groups) if config.streams == "per_group" else 1)
        self._finished: dict[Kind, set[str]] = {"store": set(), "load": set()}
        self._finished_lock = threading.Lock()
        self._commits: set[Future] = set()  # stores' commits in flight (close waits for them)
        self._store_q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        # On CUDA a direct wire's copies are queued by the caller of store() / retrieve() (they are
        # asynchronous there): no hand-off to a worker before the first byte moves, the worker only waits
        # for them. Elsewhere copies run synchronously, so they stay on the workers.
        self._issue_in_caller = self.wire.direct and self.device.type == "cuda"
        # Stores and loads on their own threads: a store parked behind L2 never delays a retrieve.
        self._workers = [threading.Thread(target=self._store_worker, name="hkv-store", daemon=True),
                         threading.Thread(target=self._load_worker, name="hkv-load", daemon=True)]
        for w in self._workers:
            w.start()

    # ---- public API -------------------------------------------------------------------------------

    def keys(self, token_ids: Sequence[int] | np.ndarray, extras: Sequence[bytes] | None = None) -> list[bytes]:
        """Chunk keys of every full chunk of `token_ids` in this engine's namespace (`extras`: what else decides
        each chunk's KV, see `hybridkv.keys.chunk_keys`)."""
        return chunk_keys(self.namespace, token_ids, self.chunk_tokens, extras)

    def lookup(self, request_id: str, token_ids: Sequence[int] | np.ndarray, skip_tokens: int = 0,
               timeout: float | None = None, extras: Sequence[bytes] | None = None) -> Hit:
        """The longest resumable prefix; its objects are pinned (and in L1) until retrieved or end_session.
        `timeout` (default: the client's) bounds the wait for the server's answer."""
        keys = self.keys(token_ids, extras)
        if not keys:
            return Hit(request_id, keys, 0, self.chunk_tokens, 0, [])
        r, _ = self.client.call(P.Lookup(engine=self.engine_id, request=request_id, keys=keys,
                                         policy=self.config.retrieve_policy,
                                         skip_chunks=skip_tokens // self.chunk_tokens), timeout=timeout)
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

    def retrieve(self, hit: Hit, block_ids: Sequence[Sequence[int]],
                 ready: torch.cuda.Event | None = None) -> TransferHandle:
        """Load a hit's objects into the engine's blocks (one list per group), asynchronously. On CUDA the
        copies start after `ready`, by default after the work already queued on the caller's current stream
        (an engine zeroes new blocks there before it loads into them). `cancel()` on the handle before the
        first page is written means none will be."""
        h = TransferHandle("load", hit.request_id)
        jobs = self._object_blocks(hit.objects, block_ids)  # validate in the caller's thread
        if not hit.objects:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            h.done.set_result(h)
            h.committed.set_result(h)
            return h
        if ready is None and self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        scatter = self.copies.copier(h, "scatter", ready)

        def copy(items: list) -> None:
            h.proceed()  # the last moment a cancel can stop the load: nothing written yet
            scatter(items)

        if not self.wire.direct:
            self._load_q.put((h, self._do_load, (hit, lambda: self.wire.load(h, hit, jobs, copy))))
        elif not self._issue_in_caller:
            self._load_q.put((h, self._do_load, (hit, lambda: copy(self.wire.slots(jobs)))))
        else:
            try:
                h.proceed()
                issued = self.copies.issue(h, "scatter", self.wire.slots(jobs), ready)
            except BaseException as e:
                self._fail(h, e)
                self._release(hit.lease, wait=False)
                return h
            self._load_q.put((h, self._do_load, (hit, lambda: self.copies.wait(h, issued))))
        return h

    def prepare_store(self, request_id: str, token_ids: Sequence[int] | np.ndarray, start_chunk: int = 0,
                      block_ids: Sequence[Sequence[int]] | None = None,
                      extras: Sequence[bytes] | None = None) -> PreparedStore:
        """Reserve the server's slots for a store ahead of it (e.g. when the request is scheduled, before its
        prefill), so that the store itself is copy + commit. Returns at once; the reply comes on the
        client's I/O thread. Delta-aware: objects the server holds when it answers get no slot. With the
        blocks the store will read (`block_ids`), they are validated now and the copy plan's engine half is
        built while the prepare is in flight."""
        keys = self.keys(token_ids, extras)
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
                prep.pages = self.copies.plan_pages("gather", jobs)
            except BaseException:
                reply.add_done_callback(self._abort_prepared)
                raise
            prep.block_ids, prep.jobs = block_ids, jobs
        return prep

    def store(self, request_id: str, token_ids: Sequence[int] | np.ndarray,
              block_ids: Sequence[Sequence[int]], start_chunk: int = 0,
              prepared: PreparedStore | None = None, extras: Sequence[bytes] | None = None) -> TransferHandle:
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
            prepared = self.prepare_store(request_id, token_ids, start_chunk, extras=extras)
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
        reply = prepared.reply
        if self._issue_in_caller and reply.done() and reply.exception() is None:
            answer = reply.result()[0]
            if (issued := self._issue_store(h, answer, jobs, pages, ready)) is not None:
                self._store_q.put((h, self._finish_store, (answer, issued)))
        else:
            self._store_q.put((h, self._do_store, (prepared, jobs, pages, ready)))
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

    def end_session_soon(self, request_id: str) -> Future:
        """end_session without waiting for the answer (an engine's step path must not block on the server)."""
        return self.client.submit(P.EndSession(engine=self.engine_id, request=request_id))

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
        self._work(self._store_q)

    def _load_worker(self) -> None:
        self._work(self._load_q)

    def _work(self, q: queue.SimpleQueue[_Item | None]) -> None:
        """Run each queued step; a failure is delivered through its handle and the worker keeps going."""
        while (item := q.get()) is not None:
            h, fn, args = item
            try:
                fn(h, *args)
            except BaseException as e:
                self._fail(h, e)

    @staticmethod
    def _fail(h: TransferHandle, e: BaseException) -> None:
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

    def _do_store(self, h: TransferHandle, prep: PreparedStore, jobs: list[ObjectJob], pages: dict | None,
                  ready: torch.cuda.Event | None) -> None:
        reply = prep.wait(self.config.timeout_s + 5)
        if self.wire.direct:
            if (issued := self._issue_store(h, reply, jobs, pages, ready)) is not None:
                self._finish_store(h, reply, issued)
            return
        if self._nothing_to_store(h, reply):
            return
        try:
            copy = self.copies.copier(h, "gather", ready, pages)
            commit = self.wire.store(h, reply.reservation, self._slot_jobs(reply, jobs), copy, ready,
                                     lambda: self._pages_read(h, reply))
        except BaseException:
            self._abort(reply.reservation)
            raise
        self._track_commit(h, reply.reservation, commit)

    def _issue_store(self, h: TransferHandle, reply: P.Prepared, jobs: list[ObjectJob], pages: dict | None,
                     ready: torch.cuda.Event | None) -> Issued | None:
        """Queue a direct wire's store copies (on the caller's thread, or the worker's). None when the handle
        is settled already: the server held or refused every object, or queueing failed (the reservation
        is aborted, the error is in the handle)."""
        if self._nothing_to_store(h, reply):
            return None
        try:
            return self.copies.issue(h, "gather", self.wire.slots(self._slot_jobs(reply, jobs)), ready, pages)
        except BaseException as e:
            self._abort(reply.reservation, wait=False)
            self._fail(h, e)
            return None

    def _finish_store(self, h: TransferHandle, reply: P.Prepared, issued: Issued) -> None:
        """A direct wire's store after its copies were queued: wait for them, then commit."""
        try:
            self.copies.wait(h, issued)
            self._pages_read(h, reply)
            commit = self.wire.commit(h, reply.reservation)
        except BaseException:
            self._abort(reply.reservation)
            raise
        self._track_commit(h, reply.reservation, commit)

    def _nothing_to_store(self, h: TransferHandle, reply: P.Prepared) -> bool:
        """True (and the handle resolved) when the server held or refused every object: no slot to fill."""
        h.skipped, h.refused = len(reply.present), len(reply.refused)
        if reply.slots:
            return False
        h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
        self._resolve_done(h)
        h.committed.set_result(h)
        return True

    @staticmethod
    def _slot_jobs(reply: P.Prepared, jobs: list[ObjectJob]) -> list[ObjectJob]:
        """The reserved slots, each with the engine blocks of its object."""
        by_object = {(o.chunk, o.group): ids for o, ids in jobs}
        return [(s, by_object[s.chunk, s.group]) for s in reply.slots]

    def _pages_read(self, h: TransferHandle, reply: P.Prepared) -> None:
        """The store's pages are read; it commits unless cancel() came first (then the caller may have
        reused the blocks while they were read: CancelledError, and the reservation is aborted)."""
        h.proceed()
        h.nbytes, h.objects = sum(s.length for s in reply.slots), len(reply.slots)
        self._resolve_done(h)

    def _track_commit(self, h: TransferHandle, reservation: int, commit: Future) -> None:
        """`committed` follows the commit's reply, on whichever thread receives it (the I/O thread for a
        payload-carrying commit: this worker goes on with the next store meanwhile)."""
        with self._finished_lock:
            self._commits.add(commit)
        commit.add_done_callback(lambda f: self._committed(h, reservation, f))

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

    def _do_load(self, h: TransferHandle, hit: Hit, move: Callable[[], None]) -> None:
        """Run `move` (the wire's fetch and copies, or the wait for copies the caller queued), then resolve
        and release the lease."""
        try:
            if not h.t_copy_start:
                h.t_copy_start = time.perf_counter()  # for raw and legacy formats: fetch, decode and copy
            move()
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

    def _release(self, lease: int, wait: bool = True) -> None:
        try:
            msg = P.Release(engine=self.engine_id, lease=lease)
            self.client.call(msg) if wait else self.client.submit(msg)
        except Exception:
            pass  # end_session or the server's reclaim drops the pins anyway
