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
from dataclasses import dataclass, field

import numpy as np
import torch
from hybridkv_kernels import PagedLayers, available_impls, build_plan, run_plan

from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.engine.wire import ArenaMapping, StagingPool, decode_objects, encode_objects
from hybridkv.keys import chunk_keys
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import POLICIES, chunk_objects, object_blocks

WIRE_FORMATS = ("shm", "raw", "pickle", "torch_save", "cuda_ipc")
COPY_ENGINES = ("auto", "kernel", "dma")
# auto's rule, from the H200 runs of 2026-11-29 (kernels/README.md, results/h200/2026-11-29/): on 3.2 MB
# pages per-page DMA reaches 0.93-0.95 of the PCIe ceiling and the Triton kernel 0.88-0.92; on 64 KiB
# pages DMA is launch-bound (0.07-0.13) and the kernel holds 0.89-0.93.
DMA_MIN_PAGE_BYTES = 1 << 20
STREAM_MODES = ("single", "per_group")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How an engine moves bytes; validated at construction."""

    wire_format: str = "shm"
    # kernel: one Triton launch per plan (the torch reference off CUDA); dma: one copy_ per run of pages;
    # auto: dma for pages of at least DMA_MIN_PAGE_BYTES, kernel for smaller ones (measured, see above)
    copy_engine: str = "auto"
    streams: str = "single"           # single: every group on one stream; per_group: a stream per group (the seed's)
    # boundary: recurrent state only at the last hit chunk; all: every chunk (the seed's)
    retrieve_policy: str = "boundary"
    store_policy: str = "boundary"    # boundary: recurrent state only at the last stored chunk; all: every chunk
    chunk_tokens: int = 0             # 0: the layout's unified block size
    tp_rank: int = 0
    salt: str = ""
    timeout_s: float = 60.0
    name: str = ""
    kernel_impl: str = "auto"         # auto: Triton on CUDA, the torch reference elsewhere; or force triton / torch

    def __post_init__(self) -> None:
        for fld, allowed in (("wire_format", WIRE_FORMATS), ("copy_engine", COPY_ENGINES),
                             ("streams", STREAM_MODES), ("retrieve_policy", POLICIES), ("store_policy", POLICIES)):
            if getattr(self, fld) not in allowed:
                raise ValueError(f"{fld} must be one of {allowed}, got {getattr(self, fld)!r}")
        if self.kernel_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"kernel_impl must be auto, triton or torch, got {self.kernel_impl!r}")
        if self.chunk_tokens < 0 or self.timeout_s <= 0:
            raise ValueError(f"chunk_tokens must be >= 0 and timeout_s > 0, got {self.chunk_tokens}, {self.timeout_s}")


@dataclass(slots=True)
class Hit:
    """A lookup's answer: the resumable prefix, and the server-side objects pinned for it."""

    request_id: str
    keys: list[bytes]
    hit_chunks: int
    chunk_tokens: int
    lease: int
    objects: list[P.ObjectLoc]

    @property
    def hit_tokens(self) -> int:
        return self.hit_chunks * self.chunk_tokens

    @property
    def nbytes(self) -> int:
        return sum(o.length for o in self.objects)


@dataclass(eq=False)
class TransferHandle:
    """An asynchronous store or retrieve. `done` resolves when the engine's pages are free to use
    (store: read; retrieve: written); for a store `committed` resolves once the server made it visible."""

    kind: str
    request_id: str
    done: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    t_submit: float = field(default_factory=time.perf_counter)
    t_copy_start: float = 0.0
    t_done: float = 0.0
    t_committed: float = 0.0
    nbytes: int = 0
    objects: int = 0
    skipped: int = 0
    refused: int = 0

    def wait(self, timeout: float | None = None) -> TransferHandle:
        """Block until the pages are safe (store: read; retrieve: written); re-raises a failure."""
        self.done.result(timeout)
        return self

    def wait_committed(self, timeout: float | None = None) -> TransferHandle:
        self.committed.result(timeout)
        return self

    @property
    def copy_s(self) -> float:
        return self.t_done - self.t_copy_start

    @property
    def total_s(self) -> float:
        return (self.t_committed or self.t_done) - self.t_submit


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
        self.impl = self._pick_impl(config, self.device)
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
        if config.wire_format == "cuda_ipc":
            if self.device.type != "cuda":
                raise ValueError("wire format cuda_ipc needs the engine's pages on a CUDA device")
            from hybridkv.baselines.cuda_ipc import export_views

            self.client.call(P.ShareCuda(engine=self.engine_id, groups=export_views(self.groups)))
        self.arena = (ArenaMapping.open(reg.arena_path, reg.arena_bytes, self.device)
                      if config.wire_format == "shm" else None)
        self.staging = StagingPool(self.device)
        cuda = self.device.type == "cuda"
        n_streams = len(self.groups) if config.streams == "per_group" else 1
        self._streams = {k: [torch.cuda.Stream(self.device) for _ in range(n_streams)] if cuda else [None]
                         for k in ("store", "load")}
        self._finished: dict[str, set[str]] = {"store": set(), "load": set()}
        self._finished_lock = threading.Lock()
        self._queues = {k: queue.SimpleQueue() for k in ("store", "load")}
        # Stores and loads on their own threads: a store parked behind L2 never delays a retrieve.
        self._workers = [threading.Thread(target=self._work, args=(k,), name=f"hkv-{k}", daemon=True)
                         for k in ("store", "load")]
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

    def _pick_impl(self, config: TransferConfig, device: torch.device) -> str:
        engine = config.copy_engine
        if engine == "auto":
            engine = "dma" if min(g.page_bytes for g in self.groups) >= DMA_MIN_PAGE_BYTES else "kernel"
        if engine == "dma":
            return "dma"
        if config.kernel_impl == "auto":
            return "triton" if device.type == "cuda" and "triton" in available_impls(device) else "torch"
        if config.kernel_impl not in available_impls(device):
            raise ValueError(f"kernel_impl {config.kernel_impl!r} cannot run on {device}; "
                             f"available: {available_impls(device)}")
        return config.kernel_impl

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

    def retrieve(self, hit: Hit, block_ids: Sequence[Sequence[int]]) -> TransferHandle:
        """Load a hit's objects into the engine's blocks (one list per group), asynchronously."""
        h = TransferHandle("load", hit.request_id)
        jobs = self._object_blocks(hit.objects, block_ids)  # validate in the caller's thread
        if not hit.objects:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            h.done.set_result(h)
            h.committed.set_result(h)
            return h
        self._queues["load"].put((h, (hit, jobs)))
        return h

    def store(self, request_id: str, token_ids: Sequence[int] | np.ndarray,
              block_ids: Sequence[Sequence[int]], start_chunk: int = 0) -> TransferHandle:
        """Store every full chunk of `token_ids` from the engine's blocks, asynchronously and delta-aware.

        Copies start after the work already queued on the caller's current CUDA stream. `done` says the
        engine may reuse the blocks; `committed` that the server made the objects visible.
        """
        keys = self.keys(token_ids)
        n = len(keys)
        objects = chunk_objects(self.layout, self.config.store_policy, start_chunk, n)
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
        self._queues["store"].put((h, (keys, objects, block_ids, ready)))
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
        for q in self._queues.values():
            q.put(None)
        for w in self._workers:
            w.join(timeout=self.config.timeout_s)
        try:
            self.client.forget(self.engine_id)
            self.client.call(P.Unregister(engine=self.engine_id), timeout=5)
        except Exception:
            pass  # the server may be gone already; it reclaims silent engines anyway
        if self._own_client:
            self.client.close()
        if self.arena is not None:
            self.arena.release()

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- workers ------------------------------------------------------------------------------------

    def _work(self, kind: str) -> None:
        while (item := self._queues[kind].get()) is not None:
            h, args = item
            try:
                (self._do_store if kind == "store" else self._do_load)(h, *args)
            except BaseException as e:  # delivered through the handle; the worker keeps going
                for f in (h.done, h.committed):
                    if not f.done():
                        f.set_exception(e)

    def _resolve_done(self, h: TransferHandle) -> None:
        """The engine's pages are free: report the request to get_finished, then wake waiters."""
        with self._finished_lock:
            self._finished[h.kind].add(h.request_id)
        h.done.set_result(h)

    def _object_blocks(self, objects: Sequence[P.ObjectLoc], block_ids: Sequence[Sequence[int]]) -> list:
        """For each object, its group's block ids: a chunk's blocks (attention) or its last block (state)."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"block ids for {len(block_ids)} groups given; the layout has {len(self.groups)}")
        return [(o, np.asarray(object_blocks(self.layout, self.chunk_tokens, o.group, o.chunk, block_ids[o.group]),
                               dtype=np.int64)) for o in objects]

    def _copy(self, kind: str, direction: str, transfers: list[tuple[int, object]], ready=None) -> None:
        """Run the page copies (grouped per stream mode) and wait for them on this worker thread."""
        streams = self._streams[kind]
        by_stream: dict[int, list] = {}
        for g, t in transfers:
            by_stream.setdefault(g % len(streams), []).append(t)
        events = []
        for i, ts in by_stream.items():
            plan = build_plan(direction, ts)
            s = streams[i]
            if s is not None and ready is not None:
                s.wait_event(ready)
            run_plan(plan, self.impl, s)
            if s is not None:
                ev = torch.cuda.Event()
                ev.record(s)
                events.append((ev, plan))
        for ev, _ in events:
            ev.synchronize()

    def _do_store(self, h: TransferHandle, keys, objects, block_ids, ready) -> None:
        fmt = self.config.wire_format
        prep, _ = self.client.call(P.PrepareStore(engine=self.engine_id, request=h.request_id, keys=keys,
                                                  objects=objects))
        h.skipped, h.refused = len(prep.present), len(prep.refused)
        if not prep.slots:
            h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
            self._resolve_done(h)
            h.committed.set_result(h)
            return
        try:
            blocks = self._object_blocks(prep.slots, block_ids)
            staging = None
            if fmt == "cuda_ipc":  # the server copies; its reply means the pages were read and committed
                if ready is not None:
                    ready.synchronize()
                h.t_copy_start = time.perf_counter()
                self.client.call(P.CommitStore(engine=self.engine_id, reservation=prep.reservation, format=fmt,
                                               blocks=[ids.tolist() for _, ids in blocks]))
                h.t_done = h.t_committed = time.perf_counter()
                h.nbytes, h.objects = sum(s.length for s in prep.slots), len(prep.slots)
                self._resolve_done(h)
                h.committed.set_result(h)
                return
            if fmt == "shm":
                dsts = [self.arena.slot(s.offset, s.length) for s in prep.slots]
            else:
                staging = self.staging.get(sum(s.length for s in prep.slots))
                dsts = list(torch.split(staging, [s.length for s in prep.slots]))
            h.t_copy_start = time.perf_counter()
            self._copy("store", "gather", [(o.group, (self.groups[o.group], ids, d))
                                           for (o, ids), d in zip(blocks, dsts, strict=True)], ready)
            h.t_done = time.perf_counter()
            h.nbytes, h.objects = sum(s.length for s in prep.slots), len(prep.slots)
            self._resolve_done(h)
            frames = [] if fmt == "shm" else encode_objects(fmt, dsts, [self.layout.groups[s.group].dtype
                                                                       for s in prep.slots])
            self.client.call(P.CommitStore(engine=self.engine_id, reservation=prep.reservation, format=fmt), frames)
            # Only after the reply: frames were sent zero-copy from the staging buffer. On a failure it is not
            # pooled again (the socket may still hold it); the garbage collector frees it with the frames.
            if staging is not None:
                self.staging.put(staging)
        except BaseException:
            try:  # nothing half-written may stay reserved on the server
                self.client.call(P.AbortStore(engine=self.engine_id, reservation=prep.reservation), timeout=5)
            except Exception:
                pass
            raise
        h.t_committed = time.perf_counter()
        h.committed.set_result(h)

    def _do_load(self, h: TransferHandle, hit: Hit, jobs) -> None:
        fmt = self.config.wire_format
        staging = None
        try:
            h.t_copy_start = time.perf_counter()
            if fmt == "cuda_ipc":  # the server writes the engine's pages itself and answers when done
                self.client.call(P.Retrieve(engine=self.engine_id, lease=hit.lease, format=fmt,
                                            blocks=[ids.tolist() for _, ids in jobs]))
                srcs = None
            elif fmt == "shm":
                srcs = [self.arena.slot(o.offset, o.length) for o in hit.objects]
            else:
                rep, frames = self.client.call(P.Retrieve(engine=self.engine_id, lease=hit.lease, format=fmt))
                if [(o.chunk, o.group) for o in rep.objects] != [(o.chunk, o.group) for o in hit.objects]:
                    raise RuntimeError(f"server returned objects {rep.objects} for lease {hit.lease}")
                srcs, staging = decode_objects(fmt, frames, [o.length for o in hit.objects], self.device, self.staging)
            if srcs is not None:
                self._copy("load", "scatter", [(o.group, (self.groups[o.group], ids, s))
                                               for (o, ids), s in zip(jobs, srcs, strict=True)])
            h.t_done = h.t_committed = time.perf_counter()
            h.nbytes, h.objects = hit.nbytes, len(hit.objects)
        finally:
            if staging is not None:
                self.staging.put(staging)
            try:
                self.client.call(P.Release(engine=self.engine_id, lease=hit.lease))
            except Exception:
                pass  # end_session or the server's reclaim drops the pins anyway
        self._resolve_done(h)
        h.committed.set_result(h)
