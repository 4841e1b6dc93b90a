"""The scheduler side's book of hits: each request's lookup (whole chunks past vLLM's own prefix-cache hit, pinned
on every rank until the request ends), the loads planned into the blocks vLLM allocated for the hits it took, and
each live request's track. It never moves a byte; any failure is a miss, logged.

With a server that has an L2, a prefix partly evicted to it is not looked up at once: a `Prefetch` starts its reads
and vLLM is told to ask again (`l2_wait_s`), so the request waits in vLLM's queue, never the scheduler.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from hybridkv.engine.client import ServerError
from hybridkv.engine.vllm.books import HitTier, PendingHit, RequestTrack, SchedulerStats
from hybridkv.engine.vllm.plan import LoadJob, PinnedHit, chunk_extras, load_job
from hybridkv.engine.vllm.scheduler_link import SchedulerLink
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import ModelLayout
from hybridkv.model.policy import Policy, check_policy
from hybridkv.wire import protocol as P

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from hybridkv.engine.vllm.events import KVEventTracker  # (it imports vLLM)

log = logging.getLogger(__name__)


class HitBook:
    """Hits reported to vLLM (`_pending`, until vLLM allocates their blocks), the loads planned for them (`loads`,
    until the step's metadata takes them) and every live request's track (`requests`)."""

    def __init__(self, link: SchedulerLink, layout: ModelLayout, stats: SchedulerStats,
                 events: KVEventTracker | None):
        self.link = link
        self.settings = link.settings
        self.layout = layout
        self.chunk_tokens = link.chunk_tokens
        self.stats = stats
        self.events = events
        self._pending: dict[str, PendingHit] = {}
        self.requests: dict[str, RequestTrack] = {}
        self.loads: list[LoadJob] = []
        self.held: set[str] = set()  # load_mode layerwise: attention parts waiting for vLLM to promote the request
        self._ending: list[Future] = []  # EndSession replies not in yet (vLLM never waits for them)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External hit beyond the local one: whole chunks, at most N-1 tokens (vLLM computes >= 1 token).
        None ("ask again next step") while the reads of a prefix partly in L2 run (`l2_wait_s`)."""
        rid = request.request_id
        track = self.requests.setdefault(rid, RequestTrack())
        track.looked_up = True
        if track.refused:
            return 0, False  # its load was refused or failed once: vLLM recomputes it
        if (pending := self._pending.get(rid)) is not None:
            if pending.skip_tokens == num_computed_tokens:
                return len(pending.token_ids) - num_computed_tokens, False  # pinned already: no second lookup
            self._release(self._pending.pop(rid))
        n_tokens = request.num_tokens
        limit = (n_tokens - 1) // self.chunk_tokens * self.chunk_tokens
        if limit <= num_computed_tokens or not self.link.workers_can_load() or not self.link.connect():
            return 0, False
        tokens = list(request.all_token_ids[:limit])
        self.stats.lookups += 1
        t0 = time.perf_counter()
        policy = check_policy(self.settings.retrieve_policy)
        skip = num_computed_tokens // self.chunk_tokens
        extras = chunk_extras(request, limit // self.chunk_tokens, self.chunk_tokens)
        p: P.Prefetching | None = None
        for again in (False, True):
            assert self.link.client is not None
            try:
                keys = [(engine, chunk_keys(ns, tokens, self.chunk_tokens, extras)) for engine, ns in self.link.ranks]
                if (p := self._prefetch(track, keys, policy, skip)) is not None:
                    if p.hit_chunks * self.chunk_tokens <= num_computed_tokens:
                        return 0, False  # nothing beyond vLLM's own hit, in L1 or L2: no lookup needed
                    if p.loading or p.started or p.waiting:  # reads from L2 still to finish: ask again next step
                        track.l2_since = track.l2_since or time.monotonic()
                        self.stats.lookups_deferred += 1
                        return None, False
                results: list[P.LookupResult] = self.link.ask_ranks(
                    [P.Lookup(engine=engine, request=rid, keys=k, policy=policy, skip_chunks=skip)
                     for engine, k in keys], self.settings.lookup_timeout_s)
                break
            except Exception as e:  # slow or gone: a miss
                self.stats.lookup_failures += 1
                # a server that answers unknown_engine restarted (or reclaimed this scheduler): it is up, so
                # register again now and ask again, once
                restarted = isinstance(e, ServerError) and e.code == P.ErrorCode.UNKNOWN_ENGINE
                self.link.drop(e, reconnect=not restarted)
                if not (restarted and not again and self.link.connect(now=True)):
                    return 0, False
            finally:
                self.stats.lookup_s += time.perf_counter() - t0
                t0 = time.perf_counter()
        # a shard one rank lacks would fail that rank's load: the hit is what every rank holds
        hit = min(r.hit_chunks for r in results) * self.chunk_tokens
        if self.events is not None:
            self.events.observed_hit(request, limit // self.chunk_tokens, hit // self.chunk_tokens)
        # a prefix that waited for L2 reads came partly from disk; one a Prefetch found in L1, or any on a server
        # without L2, came from memory; a lookup on a server with L2 and no Prefetch may have read either
        tier: HitTier = "l2" if track.l2_since else "l1" if (p is not None or not self.link.l2) else "unknown"
        leases = [(engine, r.lease) for (engine, _), r in zip(self.link.ranks, results, strict=True)]
        # the workers copy the pinned objects themselves (no lookup of their own) where every rank's hit is the
        # hit: a rank that holds more has objects past it, and its state at its own end, not the hit's
        pinned = PinnedHit(self.link.arena, [r.objects for r in results]) \
            if all(r.hit_chunks * self.chunk_tokens == hit for r in results) else None
        pending = PendingHit(tokens[:hit], num_computed_tokens, leases, extras, tier, pinned)
        if hit <= num_computed_tokens:
            self._release(pending)
            return 0, False
        self._pending[rid] = pending
        return hit - num_computed_tokens, False

    def _release(self, pending: PendingHit) -> None:
        """Drop a hit's pins on every rank without waiting (vLLM did not take it, or asks again from another
        point)."""
        if self.link.client is None:
            return
        try:
            for engine, lease in pending.leases:
                if lease:
                    self.link.client.submit(P.Release(engine=engine, lease=lease))
        except Exception as e:
            self.link.drop(e)

    def _prefetch(self, track: RequestTrack, keys: list[tuple[int, list[bytes]]], policy: Policy,
                  skip: int) -> P.Prefetching | None:
        """A Prefetch of the request's prefix (answered at once, pinning nothing; it starts the reads of what
        is only in L2), so that a prefix on disk waits in vLLM's queue instead of holding up the scheduler in a
        lookup. None where that cannot help: the server has no L2, the request waited `l2_wait_s` already
        (the lookup then waits for what is left, or times out: a miss), or the server refused the Prefetch for
        its limit (the lookup reads for itself)."""
        if not (self.link.l2 and self.settings.l2_wait_s) or (
                track.l2_since and time.monotonic() - track.l2_since >= self.settings.l2_wait_s):
            return None
        try:
            answers: list[P.Prefetching] = self.link.ask_ranks(
                [P.Prefetch(engine=engine, keys=k, policy=policy, skip_chunks=skip) for engine, k in keys],
                self.settings.lookup_timeout_s)
        except ServerError as e:
            if e.code != P.ErrorCode.LIMIT:
                raise
            return None
        # every rank's prefix: the shortest hit, and reads to wait for if any rank still has some
        return P.Prefetching(hit_chunks=min(a.hit_chunks for a in answers), in_l1=min(a.in_l1 for a in answers),
                             loading=sum(a.loading for a in answers), started=sum(a.started for a in answers),
                             waiting=sum(a.waiting for a in answers), refused=sum(a.refused for a in answers))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: plan the load of the hit it accepted."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return
        if num_external_tokens <= 0:
            self._release(pending)
            return
        if pending.skip_tokens + num_external_tokens != len(pending.token_ids):
            # vLLM trimmed the hit (e.g. a local sub-block tail); load only what it accepted, in whole chunks
            hit = (pending.skip_tokens + num_external_tokens) // self.chunk_tokens * self.chunk_tokens
            pending.token_ids = pending.token_ids[:hit]
            pending.pinned = None  # the pins hold the state at the longer hit's end: the workers look this one up
        job = load_job(self.layout, self.chunk_tokens, request.request_id, pending.token_ids, pending.skip_tokens,
                       blocks.get_block_ids(), pending.extras, pending.pinned)
        self.loads.append(job)
        if job.refused:  # vLLM expects KV the objects lack: the worker fails the load, vLLM recomputes
            log.warning("hybridkv: refusing the hit of %s: %s", request.request_id, job.refused)
            self.requests.setdefault(request.request_id, RequestTrack()).refused = True
            self._release(pending)
            return
        self.stats.hit_tokens += num_external_tokens
        setattr(self.stats, f"hit_tokens_{pending.tier}", getattr(self.stats, f"hit_tokens_{pending.tier}")
                + num_external_tokens)
        track = self.requests.setdefault(request.request_id, RequestTrack())
        track.tier = pending.tier
        if self.events is None:
            # the hit's chunks are on the server, pinned until the request ends: a store of them again (planned
            # from chunk 0 at the request's first boundary) copies nothing, yet prepares every one of them in the
            # request's first step, on its time to first token. With KV events on they are stored again all the
            # same: their commit is what this engine announces them on.
            track.stored_chunks = max(track.stored_chunks, len(pending.token_ids) // self.chunk_tokens)
        self.stats.loads_planned += 1
        if self.settings.load_mode == "layerwise":
            self.held.add(request.request_id)

    def load_failed(self, request_ids: set[str]) -> None:
        """Loads that failed on some rank (vLLM recomputes those requests): no in-step load follows them, and they
        get no external hit again. vLLM asks again right away; a failure the scheduler's own lookup cannot see
        (one rank's connection or arena) would fail every retry, each a lookup, pins and, at TP > 1, a whole load
        on the other ranks, for as long as that lasts."""
        self.held -= request_ids
        for rid in request_ids:
            if (track := self.requests.get(rid)) is not None:
                track.refused = True

    def hit_tier(self, request_id: str) -> HitTier | None:
        """Where the load planned for a live request reads from; None when none was planned."""
        track = self.requests.get(request_id)
        return track.tier if track is not None else None

    def request_finished(self, request: Request) -> None:
        """The request is done: drop the scheduler's pins for it on the server."""
        rid = request.request_id
        self._pending.pop(rid, None)
        self.held.discard(rid)
        track = self.requests.pop(rid, None)
        if self.link.client is None or track is None or not track.looked_up:
            return
        self._ending = [f for f in self._ending if not f.done()]
        try:
            self._ending.extend(self.link.client.submit(P.EndSession(engine=engine, request=rid))
                                for engine, _ in self.link.ranks)
        except Exception as e:
            self.link.drop(e)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until the server has ended the session of every finished request (the harness and tests; vLLM
        never waits). Its pins then are gone for any later message, on any connection: a Clear sent after this
        drops every object, where one that overtook the EndSession would leave the last hit's objects pinned.
        TimeoutError (or the connection's error) when the server did not confirm in time."""
        pending, self._ending = self._ending, []
        _, late = wait_futures(pending, timeout=timeout_s)
        if late:
            self._ending = [*late, *self._ending]
            raise TimeoutError(f"the cache server ended {len(pending) - len(late)} of {len(pending)} finished "
                               f"requests' sessions in {timeout_s:g} s")
        for f in pending:
            e = f.exception()
            if e is not None and not isinstance(e, ServerError):  # an answer, even an error, means it was handled
                raise ConnectionError(f"the end of a finished request's session was not confirmed: {e}") from e
