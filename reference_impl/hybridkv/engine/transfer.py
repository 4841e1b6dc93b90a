"""The engine-side transfer library: moves a hybrid model's paged KV blocks and recurrent states
between the engine's cache (GPU or CPU tensors) and the cache server, for every KV-cache group.

Shaped for a vLLM connector (KVConnectorBase_V1 + SupportsHMA): block ids come as one list per group,
lookups are synchronous, stores and retrieves are asynchronous handles, and `get_finished` reports
requests whose transfers completed. Block j of a group covers tokens [j*B, (j+1)*B) of the request;
for a recurrent group it holds the state after those tokens (vLLM's prefix-caching "align" mode).
A block id of `HOLE` (-1) says the engine holds no block there (a sliding-window group's block outside
the window, freed): a retrieve leaves that page of its object unwritten, a store leaves out every object
that would read it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import numpy as np
import torch
from hybridkv_kernels import HOLE, choose_impl

from hybridkv.engine.client import CacheClient
from hybridkv.engine.config import COPY_ENGINES, STREAM_MODES, Streams, TransferConfig
from hybridkv.engine.copies import PageCopies, layer_steps
from hybridkv.engine.handles import Hit, PreparedStore, TransferHandle
from hybridkv.engine.paged import paged_groups, same_blocks
from hybridkv.engine.routes import open_route
from hybridkv.engine.wire import WIRE_FORMATS, WIRES, ObjectJob, WireContext
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import LayoutError, ModelLayout
from hybridkv.model.policy import chunk_objects, object_blocks
from hybridkv.wire import protocol as P

__all__ = ["COPY_ENGINES", "HOLE", "STREAM_MODES", "WIRE_FORMATS", "Hit", "KVTransfer", "PreparedStore", "Streams",
           "TransferConfig", "TransferHandle"]


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
        self.arena_path = reg.arena_path  # names this server instance's arena: another's offsets mean other bytes
        self.object_bytes = reg.object_bytes
        expect = [layout.object_bytes(g, self.chunk_tokens) for g in range(len(layout.groups))]
        if self.object_bytes != expect:
            raise LayoutError(f"server sizes objects {self.object_bytes}, this engine {expect}")
        self.client.keepalive(self.engine_id, reg.heartbeat_s)
        self.wire = WIRES[config.wire_format](WireContext(
            client=self.client, engine_id=self.engine_id, device=self.device, groups=self.groups,
            dtypes=[g.dtype for g in layout.groups], arena_path=reg.arena_path, arena_bytes=reg.arena_bytes))
        self.copies = PageCopies(self.groups, self.impl, len(self.groups) if config.streams == "per_group" else 1,
                                 {k: config.link_fraction(k) for k in ("store", "load")}, config.link_gbps)
        self._layer_steps = layer_steps(layout)
        self._layer_page_bytes = [g.num_layers * g.page_bytes for g in self.groups]  # a block's bytes, per group
        # the format's route, chosen once: a direct wire's copies reach the arena, a payload wire sends frames
        self.route = open_route(self.wire, self.client, self.engine_id, self.copies, config.timeout_s,
                                fenced=config.commit == "fenced")

    # ---- public API -------------------------------------------------------------------------------

    def keys(self, token_ids: Sequence[int] | np.ndarray, extras: Sequence[bytes] | None = None) -> list[bytes]:
        """Chunk keys of every full chunk of `token_ids` in this engine's namespace (`extras`: what else decides
        each chunk's KV, see `hybridkv.model.keys.chunk_keys`)."""
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
                 ready: torch.cuda.Event | None = None, layerwise: bool = False,
                 inline: bool = False) -> TransferHandle:
        """Load a hit's objects into the engine's blocks (one list per group), asynchronously. On CUDA the
        copies start after `ready`, by default after the work already queued on the caller's current stream
        (an engine zeroes new blocks there before it loads into them). `cancel()` on the handle before the
        first page is written means none will be.

        A hit of lease 0 (a part of a pinned hit whose lease a later retrieve releases) releases nothing.

        `layerwise`: the copies go in the order a forward reads the layers (every recurrent state, then the
        other layers by index), and the handle's `wait_layer(name)` orders a reader of one layer after that
        layer's pages alone, so layer i computes while later layers load. Where the copies are not queued by
        this thread (a CPU, a payload wire) `wait_layer` waits for the whole load.

        `inline`: a direct wire on a CPU copies on the calling thread, and the handle is done (or failed) when
        this returns, instead of on the load thread. Those copies are a run of torch calls, each of which gives
        up the GIL and must take it back: beside a thread that never sleeps (an engine loop polling for the
        load), each take can wait the interpreter's whole switch interval. (On CUDA the caller's thread queues
        the copies anyway; a payload wire's load waits for the server's frames: both ignore it.)"""
        h = TransferHandle("load", hit.request_id)
        jobs = self._object_blocks(hit.objects, block_ids)  # validate in the caller's thread
        h.nbytes = self._bytes_written(jobs)
        if not hit.objects:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            h.done.set_result(h)
            h.committed.set_result(h)
            return h
        if ready is None and self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.route.load(h, hit, jobs, ready, self._layer_steps if layerwise else None, inline)
        return h

    def prepare_store(self, request_id: str, token_ids: Sequence[int] | np.ndarray, start_chunk: int = 0,
                      block_ids: Sequence[Sequence[int]] | None = None,
                      extras: Sequence[bytes] | None = None) -> PreparedStore:
        """Reserve the server's slots for a store ahead of it (e.g. when the request is scheduled, before its
        prefill), so that the store itself is copy + commit. Returns at once; the reply comes on the
        client's I/O thread. Delta-aware: objects the server holds when it answers get no slot. With the
        blocks the store will read (`block_ids`), they are validated now, an object a HOLE would read is left
        out (without them every object of the chunks is reserved), the copy plan's engine half is built while
        the prepare is in flight, and (on CUDA) the plans are bound to the slots when the answer comes."""
        prep = self._prepare(request_id, token_ids, start_chunk, block_ids, extras)
        if prep.jobs:
            self.route.prebind(prep)
        return prep

    def _prepare(self, request_id: str, token_ids: Sequence[int] | np.ndarray, start_chunk: int,
                 block_ids: Sequence[Sequence[int]] | None, extras: Sequence[bytes] | None) -> PreparedStore:
        """`prepare_store` without binding ahead: a store that prepares itself binds on its own thread at once."""
        keys = self.keys(token_ids, extras)
        objects = chunk_objects(self.layout, self.config.store_policy, start_chunk, len(keys))
        jobs = None
        if block_ids is not None:  # validated before reserving; an object a hole would read is left out
            objects, jobs = self._store_blocks(objects, block_ids)
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
                reply.add_done_callback(self.route.abort_prepared)
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
        if prepared is None:
            # bad block ids reserve nothing; objects a hole would read are left out; the plan is made here
            prepared = self._prepare(request_id, token_ids, start_chunk, block_ids, extras)
            prepared.t_submit = h.t_submit  # one span: the store's own prepare is part of it
            prepared.used = True
            objects, jobs, pages = prepared.objects, prepared.jobs or [], prepared.pages
        else:
            self._check_prepared(prepared, request_id, token_ids, start_chunk)
            prepared.used = True  # before anything can fail: an aborted reservation is never used again
            objects = prepared.objects
            try:
                pages = None
                if prepared.jobs is not None and same_blocks(prepared.block_ids, block_ids):
                    jobs, pages = prepared.jobs, prepared.pages
                else:
                    jobs = self._all_blocks(objects, block_ids)
                    if any((ids == HOLE).any() for _, ids in jobs):
                        raise ValueError("a prepared store's blocks now hold a hole where an object it reserved "
                                         "reads: prepare it again with these blocks")
            except BaseException:
                prepared.reply.add_done_callback(self.route.abort_prepared)
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
        self.route.store(h, prepared, jobs, pages, ready)
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

    def check_blocks(self, objects: Sequence[P.ObjectLoc], block_ids: Sequence[Sequence[int]]) -> None:
        """Raise where `retrieve` of `objects` into `block_ids` would (a retrieve planned for later, checked now)."""
        self._object_blocks(objects, block_ids)

    def release(self, hit: Hit) -> None:
        """Unpin a hit that will not be retrieved, without waiting for the answer."""
        self.route.release_soon(hit.lease)

    def end_session(self, request_id: str) -> int:
        """The request is finished: the server drops its pins and open reservations."""
        done, _ = self.client.call(P.EndSession(engine=self.engine_id, request=request_id))
        return done.count

    def end_session_soon(self, request_id: str) -> Future:
        """end_session without waiting for the answer (an engine's step path must not block on the server)."""
        return self.client.submit(P.EndSession(engine=self.engine_id, request=request_id))

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose stores / retrieves completed since the last call (vLLM's get_finished)."""
        return self.route.get_finished()

    def close(self) -> None:
        """Finish queued transfers, unregister, and release the arena mapping and the connection."""
        self.route.drain()
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

    # ---- block ids ----------------------------------------------------------------------------------

    def _store_blocks(self, objects: list[tuple[int, int]], block_ids: Sequence[Sequence[int]]
                      ) -> tuple[list[tuple[int, int]], list[ObjectJob]]:
        """The objects a store can read whole, and their blocks: one whose blocks hold a hole is left out (a
        sliding-window chunk whose tail the engine freed already)."""
        jobs = [(o, ids) for o, ids in self._all_blocks(objects, block_ids) if not (ids == HOLE).any()]
        if len(jobs) == len(objects):
            return objects, jobs
        return [(o.chunk, o.group) for o, _ in jobs], jobs

    def _all_blocks(self, objects: list[tuple[int, int]], block_ids: Sequence[Sequence[int]]) -> list[ObjectJob]:
        """Every (chunk, group) object's blocks, validated in the caller's thread before anything is reserved."""
        return self._object_blocks([P.ObjectLoc(c, g, 0, self.object_bytes[g]) for c, g in objects], block_ids)

    def _bytes_written(self, jobs: list[ObjectJob]) -> int:
        """The bytes a load of `jobs` writes: a hole's pages (a sliding-window block the engine does not hold)
        stay in the object. Holes are rare: one look at every block id finds there are none."""
        if not jobs:
            return 0
        page = self._layer_page_bytes
        if not (np.concatenate([ids for _, ids in jobs]) == HOLE).any():
            return sum(page[o.group] * ids.size for o, ids in jobs)
        return sum(page[o.group] * int((ids != HOLE).sum()) for o, ids in jobs)

    def _object_blocks(self, objects: Sequence[P.ObjectLoc], block_ids: Sequence[Sequence[int]]) -> list[ObjectJob]:
        """For each object, its group's block ids: a chunk's blocks (attention) or its last block (state)."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"block ids for {len(block_ids)} groups given; the layout has {len(self.groups)}")
        return [(o, np.asarray(object_blocks(self.layout, self.chunk_tokens, o.group, o.chunk, block_ids[o.group]),
                               dtype=np.int64)) for o in objects]
