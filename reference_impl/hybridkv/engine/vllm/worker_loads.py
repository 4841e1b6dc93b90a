"""A worker rank's asynchronous loads (vLLM's `load_kv_async`), from `start_load_kv` until `transfer_results`
reports them.

Each load starts its copies from the objects the scheduler side's lookup pinned (`plan.PinnedHit`: no lookup of
the worker's own, where the pins lie in the arena this rank maps), or else after a pinning lookup of its own (at
most `lookup_timeout_s`; a server that does not answer is dropped, so only the first request that meets it waits).
The copies end on their own (on a CPU they run in `start`, so the same step reports the load); the request waits in
vLLM's queue (WAITING_FOR_REMOTE_KVS) holding its blocks until `results` reports it. A load that failed, or whose
copies had not started `lookup_timeout_s` later (a payload wire's answer stuck), is reported as a failed receive,
which vLLM recomputes; a load given up before its first page write never writes. Because the load ends before the
request is scheduled, the GDN state written into block `(h-1)//B` is there when vLLM's mamba preprocessing copies it
into the request's running block. A load planned while this rank has no connection waits for its registration
(the scheduler heard the server: it offered the hit) for at most `lookup_timeout_s`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv.engine.client import ServerError
from hybridkv.engine.handles import Hit
from hybridkv.engine.transfer import KVTransfer, TransferHandle
from hybridkv.engine.vllm.layerwise import LayerwiseLoads
from hybridkv.engine.vllm.plan import LoadJob, LoadRefused
from hybridkv.engine.vllm.stats import WorkerStats
from hybridkv.engine.vllm.worker_link import WorkerLink
from hybridkv.wire.protocol import ErrorCode
from hybridkv.wire.wire_formats import traits

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Load:
    """One request's asynchronous load, from `start` until `results` reports it."""

    job: LoadJob
    deadline: float  # its copies must have started by then, or the load is given up
    handle: TransferHandle | None = None  # None: it failed before any copy (`error`), or it is `waiting`
    error: BaseException | None = None
    waiting: bool = False  # for this rank's registration (the server answered again): started once it is in
    ready: torch.cuda.Event | None = None  # after the engine's work queued before the load was asked for
    again: bool = False  # it waited for a registration once already (the server had forgotten this rank)


class WorkerLoads:
    """The loads of one rank, in flight until reported."""

    def __init__(self, link: WorkerLink, stats: WorkerStats, layerwise: LayerwiseLoads | None):
        self.link = link
        self.settings = link.settings
        self.stats = stats
        self.layerwise = layerwise
        self._loads: dict[str, _Load] = {}

    def start(self, jobs: list[LoadJob], ready: torch.cuda.Event | None) -> None:
        """Start every planned load: the pinning lookup where the scheduler's pins cannot be read (at most
        `lookup_timeout_s`), then copies ordered after `ready`, which end on their own (CUDA streams, or here on
        a CPU). Nothing here waits for a copy."""
        for job in jobs:
            load = _Load(job, 0.0)
            self._loads[job.request_id] = load
            if self.link.transfer is None and not job.refused and not self.link.refused:
                self._wait_for_registration(load, ready)
                continue
            self._begin(load, ready)

    def _wait_for_registration(self, load: _Load, ready: torch.cuda.Event | None) -> None:
        """The scheduler heard the server (it offered this hit): this rank registers again within a round trip of
        the server's answer; the load starts then (`results`), or fails `lookup_timeout_s` from now."""
        self.link.connect_soon()
        load.waiting, load.ready = True, ready
        load.deadline = time.monotonic() + self.settings.lookup_timeout_s

    def _begin(self, load: _Load, ready: torch.cuda.Event | None) -> None:
        """Start a load: its pinning lookup, then its copies (`_start_load`)."""
        job = load.job
        t0 = time.perf_counter()
        try:
            load.handle = self._start_load(job, ready)
        except Exception as e:
            if isinstance(e, ServerError) and e.code == ErrorCode.UNKNOWN_ENGINE and not load.again:
                # the server restarted (or reclaimed this rank) and answered: the registration is a round trip away
                load.again = True
                self._wait_for_registration(load, ready)
                self.stats.load_s += time.perf_counter() - t0
                return
            load.error = e
        self.stats.load_s += time.perf_counter() - t0
        # a direct wire's copies read the mapped arena, never the server: they end on their own however
        # busy the engine is, and giving them up would only cost a recompute. A payload wire's copies wait
        # for the server's frames first: those are given up if they have not started in time.
        t = self.link.transfer
        direct = t is not None and traits(t.config.wire_format).direct
        load.deadline = float("inf") if direct else time.monotonic() + self.settings.lookup_timeout_s

    def _start_load(self, job: LoadJob, ready: torch.cuda.Event | None) -> TransferHandle:
        """Start copying the hit into the blocks the scheduler side named (`plan.load_block_ids`: the ones vLLM
        expects from the connector), from the objects the scheduler's lookup pinned or else after pinning them
        under this rank's engine; a load it refused fails here. On a CPU the copies run here (`inline`): on a
        thread of their own, beside an engine loop that never sleeps (vLLM in-process), each of their torch
        calls could wait the interpreter's switch interval for the GIL."""
        if job.refused:
            raise LoadRefused(job.refused)
        t = self.link.transfer
        if t is None:
            self.link.connect_soon()
            raise ConnectionError("no connection to the cache server")
        hit = self._pinned(t, job)
        if hit is None:
            try:
                hit = t.lookup(job.request_id, job.token_ids, skip_tokens=job.skip_tokens,
                               timeout=self.settings.lookup_timeout_s, extras=job.extras)
            except (TimeoutError, ConnectionError, ServerError) as e:
                if not isinstance(e, ServerError) or e.code == ErrorCode.UNKNOWN_ENGINE:
                    self.link.drop(t, e)  # the server is gone, hung or forgot us: reconnect once it answers, off-step
                raise
            if hit.hit_tokens < len(job.token_ids):
                t.end_session_soon(job.request_id)
                raise LookupError(f"the server holds {hit.hit_tokens} of the {len(job.token_ids)} hit tokens now")
        # load_mode layerwise: the GDN states now, the attention part held (pinned) for the request's first step
        return t.retrieve(hit if self.layerwise is None else self.layerwise.hold(t, hit, job), job.block_ids, ready,
                          inline=True)

    def _pinned(self, t: KVTransfer, job: LoadJob) -> Hit | None:
        """This rank's part of the scheduler's lookup, pinned under the scheduler's leases until the request ends
        (lease 0: the load releases nothing). None where this rank must look the hit up itself: none was handed
        down, a payload wire (the server sends the bytes of a lease of this rank's own engine), or the pins lie
        in another arena than the one this rank maps (the server restarted in between: those offsets would
        read other bytes)."""
        p = job.pinned
        if p is None or self.link.tp_rank >= len(p.objects) or p.arena != t.arena_path \
                or not traits(t.config.wire_format).direct:
            return None
        self.stats.loads_pinned += 1
        return Hit(job.request_id, [], len(job.token_ids) // self.link.chunk_tokens, self.link.chunk_tokens, 0,
                   p.objects[self.link.tp_rank])

    def results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) loads since the last call; a failed one is also finished (vLLM's contract). A
        load whose lookup is overdue is given up here, so a hung server costs a recompute, not a wait."""
        finished: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for load in self._loads.values():
            if load.waiting and (self.link.transfer is not None or now > load.deadline):
                load.waiting = False
                if self.link.transfer is not None:
                    self._begin(load, load.ready)
                else:
                    load.error = ConnectionError(f"no connection to the cache server within "
                                                 f"{self.settings.lookup_timeout_s:g} s")
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            if load.waiting:
                continue
            h = load.handle
            if h is None or h.done.done():
                if h is not None and h.done.exception() is None:
                    self.stats.loads += 1
                    self.stats.loaded_bytes += h.nbytes
                else:
                    failed.add(rid)
                    self.stats.load_failures += 1
                    log.warning("hybridkv: load of %s failed (%s); vLLM recomputes it", rid,
                                load.error if h is None else h.done.exception())
            elif now > load.deadline and h.cancel():
                failed.add(rid)
                self.stats.load_failures += 1
                self.stats.loads_given_up += 1
                log.warning("hybridkv: load of %s given up: its copies had not started %.2g s after it was asked "
                            "for; vLLM recomputes it", rid, self.settings.lookup_timeout_s)
            else:
                continue
            del self._loads[rid]
            finished.add(rid)
        return finished, failed

    def wait(self, until: float) -> None:
        """Wait for the copies of every load in flight, until the monotonic time `until` at most."""
        for load in list(self._loads.values()):
            if load.handle is not None:
                try:
                    load.handle.wait(max(0.0, until - time.monotonic()))
                except Exception:
                    pass  # reported by results
