"""The connector's scheduler half: turns lookups into external hits, plans loads into the blocks vLLM
allocated and stores of the chunks whose boundary state vLLM offers. It never moves a byte.

A server that is down, slow or refusing costs hits: every call here has a short timeout, and any failure
is a miss, logged. A connection that failed is made again on a thread of its own the moment the server answers
a probe (`health.Reconnector`); a server that answers `unknown_engine` (restarted) gets a new registration at
once, and the lookup is asked again. Hits are offered only while every worker rank can load them
(`health.WorkerHealth`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.engine.vllm.books import HitTier, PendingHit, RequestTrack, SchedulerStats
from hybridkv.engine.vllm.checkpoints import ask_for_state
from hybridkv.engine.vllm.health import REFUSED, ConnState, Reconnector, Refused
from hybridkv.engine.vllm.layerwise import promoted
from hybridkv.engine.vllm.plan import (
    HybridKVMetadata,
    LoadJob,
    PinnedHit,
    StoreJob,
    boundary_stores,
    chunk_extras,
    load_job,
    step_stores,
)
from hybridkv.engine.vllm.settings import ConnectorSettings, no_server_at_start
from hybridkv.keys import chunk_keys
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import Policy, check_policy

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from hybridkv.engine.vllm.events import KVEventTracker  # (it imports vLLM)

log = logging.getLogger(__name__)

RESET_TIMEOUT_S = 5.0  # how long vLLM's reset of the external cache waits for the server's answer


class SchedulerSide:
    """Lookups and transfer plans for one vLLM scheduler. Each tensor-parallel rank stores its own shard under
    its own namespace, so the scheduler registers once per rank and a hit is what every rank holds (the
    shortest of the ranks' prefixes), pinned on every rank until the request ends."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, chunk_tokens: int, tp_size: int = 1,
                 events: KVEventTracker | None = None):
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.settings = settings
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.events = events  # KV events for vLLM's publisher; None when it publishes none
        self.stats = SchedulerStats()
        self._client: CacheClient | None = None
        self._ranks: list[tuple[int, bytes]] = []  # (engine, namespace) of each rank, rank 0 first
        self._l2 = False  # the server has an L2: only then can a prefix have to come back from disk
        self.server_epoch = 0  # registrations since the first: the workers check theirs when it moves
        self._workers: dict[int, ConnState] = {}  # each worker rank's connection, as it last reported it
        self._arena = ""  # the server's arena file: where the objects a lookup pins lie, for the workers
        self._pending: dict[str, PendingHit] = {}
        self._requests: dict[str, RequestTrack] = {}
        self._loads: list[LoadJob] = []
        self._held: set[str] = set()  # load_mode layerwise: attention parts waiting for vLLM to promote the request
        self._ending: list[Future] = []  # EndSession replies not in yet (vLLM never waits for them)
        self._reconnector = Reconnector(settings.endpoint, self._reregister, settings.retry_s,
                                        "hkv-vllm-sched-connect")
        self._reconnecting: Future | None = None  # its attempt in flight, or done and not taken yet
        self._connect(at_start=True)

    # ---- the server connection ------------------------------------------------------------------

    def _register(self) -> tuple[CacheClient, list[P.Registered]]:
        """A Register per rank on a new connection, all in flight at once, awaited (`lookup_timeout_s`)."""
        client = CacheClient(self.settings.endpoint, timeout_s=self.settings.lookup_timeout_s)
        try:
            futs = [client.submit(P.Register(layout=self.layout, chunk_tokens=self.chunk_tokens, tp_rank=rank,
                                             salt=self.settings.salt, name=f"vllm-scheduler-rank{rank}"))
                    for rank in range(self.tp_size)]
            regs = [f.result(timeout=self.settings.lookup_timeout_s + 5)[0] for f in futs]
            expect = [self.layout.object_bytes(g, self.chunk_tokens) for g in range(len(self.layout.groups))]
            for reg in regs:
                if reg.object_bytes != expect:
                    raise LayoutError(f"cache server sizes objects {reg.object_bytes}, vLLM's layout {expect}")
        except BaseException:
            client.close()
            raise
        return client, regs

    def _reregister(self) -> tuple[CacheClient, list[P.Registered]]:
        """The reconnect thread's registration, once the server answered a probe (a refusal waits `retry_s`)."""
        try:
            return self._register()
        except (ServerError, LayoutError) as e:  # e.g. restarted with another chunk size: a logged miss
            raise Refused(str(e)) from e

    def _connect(self, at_start: bool = False, now: bool = False) -> bool:
        """True when registered. Otherwise False (a miss for now), with a reconnect under way that registers the
        moment the server answers; once that is in, it is taken here. At start-up (and with `now`: the server
        has just answered) the registration is made on this thread; at start-up a layout the server refuses is
        a LayoutError."""
        if self._client is not None:
            return True
        if at_start or now:
            try:
                client, regs = self._register()
            except (ServerError, LayoutError) as e:
                if at_start and (isinstance(e, LayoutError) or e.code == P.ErrorCode.LAYOUT):
                    raise LayoutError(f"cache server {self.settings.endpoint} refused vLLM's layout: {e}") from None
                return self._unreachable(e)
            except Exception as e:  # timeout, bad endpoint: the server is down
                if at_start:
                    log.error(no_server_at_start(self.settings, e))
                return self._unreachable(e)
        else:
            fut = self._reconnect_soon()
            if not fut.done() and self._reconnector.answered.is_set():
                wait_futures([fut], timeout=self.settings.lookup_timeout_s)  # registering: one round trip away
            if not fut.done():
                return False
            self._reconnecting = None
            if fut.exception() is not None:
                return False
            client, regs = fut.result()
        for reg in regs:
            client.keepalive(reg.engine, reg.heartbeat_s)
        again = bool(self._ranks)
        self._client, self._l2, self._arena = client, regs[0].l2, regs[0].arena_path
        self._ranks = [(reg.engine, reg.namespace) for reg in regs]
        if again:
            self.server_epoch += 1
            log.info("hybridkv: registered with cache server %s again", self.settings.endpoint)
        return True

    def _unreachable(self, e: BaseException) -> bool:
        log.warning("hybridkv: cache server %s unreachable (%s); no external hits until it answers",
                    self.settings.endpoint, e)
        self._reconnect_soon()
        return False

    def _reconnect_soon(self) -> Future:
        """The reconnect attempt (registering the moment the server answers), started if none is under way."""
        if self._reconnecting is None:
            self._reconnecting = self._reconnector.start()
        return self._reconnecting

    def _drop_connection(self, e: BaseException, reconnect: bool = True) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
        if reconnect:
            self._unreachable(e)

    def worker_health(self, states: dict[int, ConnState]) -> None:
        """Worker ranks' connection states that changed (`health.WorkerHealth`, from the step's outputs)."""
        self._workers.update(states)

    def workers_can_load(self) -> bool:
        """No rank reports a registration the server refused: a hit offered now would fail its load there. (A
        rank that is only reconnecting registers again as soon as the server answers the scheduler's lookup, and
        its load waits for that.)"""
        return REFUSED not in self._workers.values()

    # ---- vLLM's scheduler calls -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External hit beyond the local one: whole chunks, at most N-1 tokens (vLLM computes >= 1 token).
        None ("ask again next step") while the reads of a prefix partly in L2 run (`l2_wait_s`)."""
        rid = request.request_id
        track = self._requests.setdefault(rid, RequestTrack())
        track.looked_up = True
        if track.refused:
            return 0, False  # its load was refused or failed once: vLLM recomputes it
        if (pending := self._pending.get(rid)) is not None:
            if pending.skip_tokens == num_computed_tokens:
                return len(pending.token_ids) - num_computed_tokens, False  # pinned already: no second lookup
            self._release(self._pending.pop(rid))
        n_tokens = request.num_tokens
        limit = (n_tokens - 1) // self.chunk_tokens * self.chunk_tokens
        if limit <= num_computed_tokens or not self.workers_can_load() or not self._connect():
            return 0, False
        tokens = list(request.all_token_ids[:limit])
        self.stats.lookups += 1
        t0 = time.perf_counter()
        policy = check_policy(self.settings.retrieve_policy)
        skip = num_computed_tokens // self.chunk_tokens
        extras = chunk_extras(request, limit // self.chunk_tokens, self.chunk_tokens)
        p: P.Prefetching | None = None
        for again in (False, True):
            assert self._client is not None
            try:
                keys = [(engine, chunk_keys(ns, tokens, self.chunk_tokens, extras)) for engine, ns in self._ranks]
                if (p := self._prefetch(track, keys, policy, skip)) is not None:
                    if p.hit_chunks * self.chunk_tokens <= num_computed_tokens:
                        return 0, False  # nothing beyond vLLM's own hit, in L1 or L2: no lookup needed
                    if p.loading or p.started or p.waiting:  # reads from L2 still to finish: ask again next step
                        track.l2_since = track.l2_since or time.monotonic()
                        self.stats.lookups_deferred += 1
                        return None, False
                results: list[P.LookupResult] = self._ask_ranks(
                    [P.Lookup(engine=engine, request=rid, keys=k, policy=policy, skip_chunks=skip)
                     for engine, k in keys], self.settings.lookup_timeout_s)
                break
            except Exception as e:  # slow or gone: a miss
                self.stats.lookup_failures += 1
                # a server that answers unknown_engine restarted (or reclaimed this scheduler): it is up, so
                # register again now and ask again, once
                restarted = isinstance(e, ServerError) and e.code == P.ErrorCode.UNKNOWN_ENGINE
                self._drop_connection(e, reconnect=not restarted)
                if not (restarted and not again and self._connect(now=True)):
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
        tier: HitTier = "l2" if track.l2_since else "l1" if (p is not None or not self._l2) else "unknown"
        leases = [(engine, r.lease) for (engine, _), r in zip(self._ranks, results, strict=True)]
        # the workers copy the pinned objects themselves (no lookup of their own) where every rank's hit is the
        # hit: a rank that holds more has objects past it, and its state at its own end, not the hit's
        pinned = PinnedHit(self._arena, [r.objects for r in results]) \
            if all(r.hit_chunks * self.chunk_tokens == hit for r in results) else None
        pending = PendingHit(tokens[:hit], num_computed_tokens, leases, extras, tier, pinned)
        if hit <= num_computed_tokens:
            self._release(pending)
            return 0, False
        self._pending[rid] = pending
        return hit - num_computed_tokens, False

    def _ask_ranks(self, msgs: list, timeout: float) -> list:
        """One request per rank, all in flight at once (one round trip whatever the TP size), and their
        replies in rank order within `timeout`. Rank 0's is answered on this thread (`call`, no hand-off from
        the client's I/O thread: the single-rank case stays one plain call); the others are sent first."""
        assert self._client is not None
        until = time.monotonic() + timeout
        others = [self._client.submit(m) for m in msgs[1:]]
        first, _ = self._client.call(msgs[0], timeout=timeout)
        return [first, *(f.result(timeout=max(0.0, until - time.monotonic()))[0] for f in others)]

    def _release(self, pending: PendingHit) -> None:
        """Drop a hit's pins on every rank without waiting (vLLM did not take it, or asks again from another
        point)."""
        if self._client is None:
            return
        try:
            for engine, lease in pending.leases:
                if lease:
                    self._client.submit(P.Release(engine=engine, lease=lease))
        except Exception as e:
            self._drop_connection(e)

    def _prefetch(self, track: RequestTrack, keys: list[tuple[int, list[bytes]]], policy: Policy,
                  skip: int) -> P.Prefetching | None:
        """A Prefetch of the request's prefix (answered at once, pinning nothing; it starts the reads of what
        is only in L2), so that a prefix on disk waits in vLLM's queue instead of holding up the scheduler in a
        lookup. None where that cannot help: the server has no L2, the request waited `l2_wait_s` already
        (the lookup then waits for what is left, or times out: a miss), or the server refused the Prefetch for
        its limit (the lookup reads for itself)."""
        if not (self._l2 and self.settings.l2_wait_s) or (
                track.l2_since and time.monotonic() - track.l2_since >= self.settings.l2_wait_s):
            return None
        try:
            answers: list[P.Prefetching] = self._ask_ranks(
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
        self._loads.append(job)
        if job.refused:  # vLLM expects KV the objects lack: the worker fails the load, vLLM recomputes
            log.warning("hybridkv: refusing the hit of %s: %s", request.request_id, job.refused)
            self._requests.setdefault(request.request_id, RequestTrack()).refused = True
            self._release(pending)
            return
        self.stats.hit_tokens += num_external_tokens
        setattr(self.stats, f"hit_tokens_{pending.tier}", getattr(self.stats, f"hit_tokens_{pending.tier}")
                + num_external_tokens)
        track = self._requests.setdefault(request.request_id, RequestTrack())
        track.tier = pending.tier
        if self.events is None:
            # the hit's chunks are on the server, pinned until the request ends: a store of them again (planned
            # from chunk 0 at the request's first boundary) copies nothing, yet prepares every one of them in the
            # request's first step, on its time to first token. With KV events on they are stored again all the
            # same: their commit is what this engine announces them on.
            track.stored_chunks = max(track.stored_chunks, len(pending.token_ids) // self.chunk_tokens)
        self.stats.loads_planned += 1
        if self.settings.load_mode == "layerwise":
            self._held.add(request.request_id)

    def ask_for_states(self, request: Request, done: int) -> None:
        """Before a request's next step (it will have computed `done` tokens): ask vLLM to keep the GDN state at
        the next boundary of the `state_every_chunks` grid (`checkpoints.py`). Models without recurrent groups
        keep nothing of the kind."""
        every = self.settings.state_every_chunks
        decoding = done >= request.num_prompt_tokens
        if every and decoding:
            # decode ends a step at every token anyway: a state at each chunk of the answer costs its bytes only,
            # and the next chat turn resumes at the answer's last whole chunk whatever the prefill grid is
            every = 1
        if self.layout.recurrent_groups:
            ask_for_state(request, done, every * self.chunk_tokens, nearer=decoding)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> HybridKVMetadata:
        """This step's loads, and stores of the chunks up to each boundary state vLLM offers (a model without
        recurrent groups: of every chunk this step completes)."""
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            if (req := requests.get(rid)) is not None:
                # computed by the end of this step (vLLM adds `scheduled` after this call), of tokens known now: under
                # async scheduling decode's last token is a placeholder until the next step, and vLLM keeps the
                # state of a block whose last token it does not know yet only once it does, at the same junction
                self.ask_for_states(req, min(req.num_computed_tokens + scheduled, req.num_tokens))
        meta = HybridKVMetadata(loads=self._loads, server_epoch=self.server_epoch)
        self._loads = []
        if self._held and (step_loads := promoted(self._held, requests)):
            meta.step_loads = step_loads  # their blocks are in vLLM's prefix cache from this step on
            scheduler_output.has_sync_kv_loads = True  # so vLLM starts this step's loads before its forward
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return meta
        if not self.layout.recurrent_groups:
            meta.stores.extend(self._plan_step_stores(scheduler_output, requests, state))
            return meta
        for rid, offers in state.boundary_state_offloads.items():
            req, track, blocks = requests.get(rid), self._requests.get(rid), state.get_block_ids(rid)
            if req is not None and track is not None and blocks is not None:
                meta.stores.extend(self._count(track, req, boundary_stores(self.layout, self.chunk_tokens, req,
                                                                           offers, blocks, track.stored_chunks)))
        return meta

    def _plan_step_stores(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                          state) -> list[StoreJob]:
        """Attention and sliding-window groups alone (Gemma 3, gpt-oss): every chunk this step completes."""
        jobs = []
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            if (req := requests.get(rid)) is None or (track := self._requests.get(rid)) is None:
                continue
            # computed by the end of this step; only known tokens (an async step's next input is a placeholder)
            end = min(req.num_computed_tokens + scheduled, req.num_tokens)
            if end // self.chunk_tokens > track.stored_chunks and (blocks := state.get_block_ids(rid)) is not None:
                jobs.extend(self._count(track, req, step_stores(self.layout, self.chunk_tokens, req, end, blocks,
                                                                track.stored_chunks)))
        return jobs

    def _count(self, track: RequestTrack, req: Request, jobs: list[StoreJob]) -> list[StoreJob]:
        """Stores planned for a request: it is stored up to their last chunk (KV events: each is announced once
        every rank committed it)."""
        for job in jobs:
            end = len(job.token_ids) // self.chunk_tokens
            if self.events is not None:
                self.events.planned(req, job.start_chunk, end)
            track.stored_chunks = max(track.stored_chunks, end)
            self.stats.stores_planned += 1
        return jobs

    def load_failed(self, request_ids: set[str]) -> None:
        """Loads that failed on some rank (vLLM recomputes those requests): no in-step load follows them, and they
        get no external hit again. vLLM asks again right away; a failure the scheduler's own lookup cannot see
        (one rank's connection or arena) would fail every retry, each a lookup, pins and, at TP > 1, a whole load
        on the other ranks, for as long as that lasts."""
        self._held -= request_ids
        for rid in request_ids:
            if (track := self._requests.get(rid)) is not None:
                track.refused = True

    def hit_tier(self, request_id: str) -> HitTier | None:
        """Where the load planned for a live request reads from; None when none was planned."""
        track = self._requests.get(request_id)
        return track.tier if track is not None else None

    def request_finished(self, request: Request) -> None:
        """The request is done: drop the scheduler's pins for it on the server."""
        rid = request.request_id
        self._pending.pop(rid, None)
        self._held.discard(rid)
        track = self._requests.pop(rid, None)
        if self._client is None or track is None or not track.looked_up:
            return
        self._ending = [f for f in self._ending if not f.done()]
        try:
            self._ending.extend(self._client.submit(P.EndSession(engine=engine, request=rid))
                                for engine, _ in self._ranks)
        except Exception as e:
            self._drop_connection(e)

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

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (`POST /reset_prefix_cache?reset_external=true`):
        drop every object this deployment's ranks stored, from the server's memory and disk. Objects pinned by
        running requests stay, as vLLM's own reset leaves running requests' blocks. False when the server is
        unreachable or did not confirm within RESET_TIMEOUT_S (vLLM's engine waits for this call; the server may
        still finish the drop)."""
        if not self._connect(at_start=True):
            return False
        try:
            dropped = sum(d.count for d in self._ask_ranks([P.Clear(engine=e) for e, _ in self._ranks],
                                                            RESET_TIMEOUT_S))
        except Exception as e:
            log.warning("hybridkv: the cache server did not confirm the reset (%s)", e)
            self._drop_connection(e)
            return False
        log.info("hybridkv: reset: the cache server dropped %d objects of this deployment", dropped)
        if self.events is not None:
            self.events.cleared()
        return True

    def close(self) -> None:
        self._reconnector.close()
        if self._client is not None:
            try:
                for engine, _ in self._ranks:
                    self._client.forget(engine)
                    self._client.call(P.Unregister(engine=engine), timeout=2)
            except Exception:
                pass  # the server reclaims silent engines anyway
            self._client.close()
            self._client = None
