"""Request handlers of the cache server: engines, lookup (hit rule, pins, L2 prefetch), store, retrieve.

Handlers run on the server's loop thread. A handler returns (reply, frames) to answer at once, or
None when it answers later itself (a parked operation, or work handed to an I/O thread).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from hybridkv import __version__
from hybridkv import protocol as P
from hybridkv.baselines.codec import bytes_to_tensor, copy_tensor_into, decode_tensor, encode_tensor
from hybridkv.keys import KEY_BYTES, namespace
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.policy import resume_objects
from hybridkv.server.l1 import WAIT, Entry, State

E = P.ErrorCode
MAX_KEYS = 1 << 20


class RequestError(Exception):
    """A request the server refuses; becomes an Error reply, and the server keeps serving."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, eq=False)
class EngineInfo:
    id: int
    name: str
    layout: ModelLayout
    ns: bytes
    chunk_tokens: int
    object_bytes: list[int]
    last_seen: float
    reservations: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class Reservation:
    id: int
    engine: int
    request: str
    slots: list[tuple[int, int, Entry]]  # (chunk, group, entry)
    committing: bool = False
    dead: bool = False  # its engine was dropped while a commit copy was in flight


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    engine: int
    request: str
    entries: list[Entry]
    locs: list[P.ObjectLoc]


def _no_frames(msg: P.Message, frames: list) -> None:
    if frames:
        raise RequestError(E.BAD_PAYLOAD, f"{type(msg).__name__} carries no payload frames, got {len(frames)}")


def _check_keys(keys: list[bytes]) -> list[bytes]:
    if len(keys) > MAX_KEYS:
        raise RequestError(E.BAD_REQUEST, f"{len(keys)} keys in one request; at most {MAX_KEYS}")
    for i, k in enumerate(keys):
        if len(k) != KEY_BYTES:
            raise RequestError(E.BAD_REQUEST, f"key {i} is {len(k)} bytes; chunk keys are {KEY_BYTES} bytes")
    return keys


class RequestHandlers:
    """Mixed into CacheServer; uses its tables (l1, l2, _engines, _reservations, _leases, ...)."""

    # ---- engines -------------------------------------------------------------------------------

    def _engine(self, engine_id: int) -> EngineInfo:
        eng = self._engines.get(engine_id)
        if eng is None:
            raise RequestError(E.UNKNOWN_ENGINE, f"engine {engine_id} is not registered (register first; "
                               f"engines silent for {self.config.client_timeout_s:g}s are reclaimed)")
        eng.last_seen = time.monotonic()
        return eng

    def _register(self, ident: bytes, msg: P.Register, frames: list):
        _no_frames(msg, frames)
        layout = msg.layout
        forced = self.config.chunk_tokens
        chunk = msg.chunk_tokens or forced or layout.default_chunk_tokens()
        if forced and chunk != forced:
            raise RequestError(E.LAYOUT, f"this server caches chunks of {forced} tokens; engine asked for {chunk}")
        try:
            ns = namespace(layout, msg.tp_rank, chunk, msg.salt)
        except LayoutError as e:
            raise RequestError(E.LAYOUT, str(e)) from None
        sizes = [layout.object_bytes(g, chunk) for g in range(len(layout.groups))]
        if self.l1.alloc.rounded(max(sizes)) > self.l1.alloc.size:
            raise RequestError(E.LAYOUT, f"one object of {max(sizes)} B does not fit in the {self.l1.alloc.size} B "
                               "L1 arena; start the server with a larger L1 or use smaller chunks")
        eid = self._new_id()
        self._engines[eid] = EngineInfo(eid, msg.name or f"engine-{eid}", layout, ns, chunk, sizes,
                                        time.monotonic())
        self.counters["engines_registered"] += 1
        return P.Registered(engine=eid, namespace=ns, object_bytes=sizes, arena_path=str(self.arena.path),
                            arena_bytes=self.arena.size, heartbeat_s=self.config.client_timeout_s / 3), []

    def _unregister(self, ident: bytes, msg: P.Unregister, frames: list):
        _no_frames(msg, frames)
        self._drop_engine(self._engine(msg.engine), reclaimed=False)
        return P.Done(), []

    def _heartbeat(self, ident: bytes, msg: P.Heartbeat, frames: list):
        _no_frames(msg, frames)
        self._engine(msg.engine)
        return P.Done(), []

    def _drop_engine(self, eng: EngineInfo, reclaimed: bool) -> None:
        for lid in list(eng.leases):
            self._unpin_lease(self._leases.pop(lid))
        for rid in list(eng.reservations):
            res = self._reservations.pop(rid)
            if res.committing:
                res.dead = True  # the copy finishes on its thread, then its slots are freed
                continue
            self._free_slots(res, quarantine=reclaimed)
            if reclaimed:
                self.counters["reservations_reclaimed"] += 1
            else:
                self.counters["objects_aborted"] += len(res.slots)
        self._cuda_engines.pop(eng.id, None)
        del self._engines[eng.id]

    def _share_cuda(self, ident: bytes, msg: P.ShareCuda, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        if not self.config.cuda_ipc:
            raise RequestError(E.BAD_REQUEST, "this server is CPU-only and never maps GPU memory; start it with "
                               "--cuda-ipc to measure the CUDA-IPC baseline")
        layout = eng.layout
        if [len(g) for g in msg.groups] != [g.num_layers for g in layout.groups]:
            raise RequestError(E.LAYOUT, f"shared {[len(g) for g in msg.groups]} layers per group; the layout has "
                               f"{[g.num_layers for g in layout.groups]}")
        from hybridkv.baselines.cuda_ipc import MappedEngine  # imports torch and initialises CUDA: the baseline's cost

        try:
            self._cuda_engines[eng.id] = MappedEngine(msg.groups, self.arena.buf,
                                                      [g.page_bytes for g in layout.groups])
        except (ValueError, RuntimeError) as e:
            raise RequestError(E.BAD_REQUEST, f"cannot map the engine's CUDA pages: {e}") from None
        return P.Done(count=sum(len(g) for g in msg.groups)), []

    def _cuda_copy(self, eng: EngineInfo, direction: str, objects: list, blocks: list[list[int]]):
        """Validate a cuda_ipc copy request and return the job's argument list."""
        mapped = self._cuda_engines.get(eng.id)
        if mapped is None:
            raise RequestError(E.BAD_REQUEST, f"engine {eng.id} shared no CUDA pages (send share_cuda first)")
        if len(blocks) != len(objects):
            raise RequestError(E.BAD_REQUEST, f"{len(blocks)} block lists for {len(objects)} objects")
        out = []
        for i, ((c, g, e), ids) in enumerate(zip(objects, blocks, strict=True)):
            grp = eng.layout.groups[g]
            if len(ids) * grp.num_layers * grp.page_bytes != e.length:
                raise RequestError(E.BAD_REQUEST, f"object {i} (chunk {c}, group {g}) is {e.length} B; "
                                   f"{len(ids)} blocks of {grp.num_layers} layers do not fill it")
            out.append((g, ids, e.offset, e.length))
        return mapped, direction, out

    def _cuda_job(self, arg) -> None:
        mapped, direction, objects = arg
        mapped.copy(direction, objects)

    # ---- lookup --------------------------------------------------------------------------------

    def _available(self, oid: tuple[bytes, int], length: int) -> bool:
        e = self.l1.get(oid)
        if e is not None:
            return e.state is not State.RESERVED
        return self.l2 is not None and self.l2.length(*oid) == length

    def _hit(self, eng: EngineInfo, keys: list[bytes], policy: str, missing: set) -> int:
        """Longest n such that every needed object of chunks < n exists and every recurrent group
        has its state at chunk n-1 (DESIGN.md: a prefix without its state is a miss at that length)."""
        groups = eng.layout.attention_groups if policy == "boundary" else range(len(eng.layout.groups))
        ok = lambda k, g: (k, g) not in missing and self._available((k, g), eng.object_bytes[g])
        full = 0
        for k in keys:
            if not all(ok(k, g) for g in groups):
                break
            full += 1
        for n in range(full, 0, -1):
            if all(ok(keys[n - 1], g) for g in eng.layout.recurrent_groups):
                return n
        return 0

    def _needed(self, eng: EngineInfo, keys: list[bytes], n: int, policy: str, skip: int) -> list[tuple[int, int]]:
        """(chunk, group) objects an engine must load to resume at n chunks, in retrieve order."""
        return resume_objects(eng.layout, policy, n, skip)

    def _lookup(self, ident: bytes, msg: P.Lookup, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        keys = _check_keys(msg.keys)
        if msg.skip_chunks < 0:
            raise RequestError(E.BAD_REQUEST, f"skip_chunks must be >= 0, got {msg.skip_chunks}")
        self.counters["lookups"] += 1
        self.counters["lookup_chunks"] += len(keys)
        if not msg.pin:
            n = self._hit(eng, keys, msg.policy, set())
            self.counters["hit_chunks"] += n
            return P.LookupResult(hit_chunks=n, lease=0, objects=[]), []
        op = _LookupOp(self, ident, msg, eng, keys)
        if not op.step():
            self._parked.append(op)
        return None

    def _start_prefetch(self, key: bytes, group: int, ns: bytes, length: int):
        """Reserve a slot and read an L2 object into it; the entry is LOADING until the read ends."""
        r = self.l1.reserve(key, group, ns, length, state=State.LOADING)
        if isinstance(r, Entry):
            self.counters["l2_prefetches"] += 1
            self._submit(self._prefetch_job, r, self._prefetch_done)
        return r

    def _prefetch_job(self, e: Entry) -> bool:
        return self.l2.get_into(e.key, e.group, self.arena.view(e.offset, e.length))

    def _prefetch_done(self, e: Entry, ok: bool | None, exc: BaseException | None) -> None:
        if ok and exc is None:
            e.in_l2 = True
            self.l1.make_ready(e)
            self.counters["l2_prefetch_bytes"] += e.length
        else:
            # a bad or vanished L2 file is a miss: the lookup recomputes its hit without it
            self.counters["l2_prefetch_failures"] += 1
            self.l1.drop(e)

    # ---- store ---------------------------------------------------------------------------------

    def _prepare(self, ident: bytes, msg: P.PrepareStore, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        keys = _check_keys(msg.keys)
        seen = set()
        for c, g in msg.objects:
            if not 0 <= c < len(keys) or not 0 <= g < len(eng.layout.groups):
                raise RequestError(E.BAD_REQUEST, f"object (chunk {c}, group {g}) outside {len(keys)} keys "
                                   f"x {len(eng.layout.groups)} groups")
            if (c, g) in seen:
                raise RequestError(E.BAD_REQUEST, f"object (chunk {c}, group {g}) listed twice")
            seen.add((c, g))
        op = _PrepareOp(self, ident, msg, eng, keys)
        if not op.step():
            self._parked.append(op)
        return None

    def _reservation(self, eng: EngineInfo, rid: int) -> Reservation:
        res = self._reservations.get(rid)
        if res is None or res.engine != eng.id:
            raise RequestError(E.UNKNOWN_RESERVATION, f"reservation {rid} is not open for engine {eng.id} "
                               "(never made, already committed or aborted, or reclaimed)")
        if res.committing:
            raise RequestError(E.UNKNOWN_RESERVATION, f"reservation {rid} is already being committed")
        return res

    def _commit(self, ident: bytes, msg: P.CommitStore, frames: list):
        eng = self._engine(msg.engine)
        res = self._reservation(eng, msg.reservation)
        if msg.format == "shm":
            _no_frames(msg, frames)
            return self._finish_commit(res), []
        if msg.format == "cuda_ipc":
            _no_frames(msg, frames)
            job = self._cuda_copy(eng, "gather", res.slots, msg.blocks)
            res.committing = True
            self._submit(self._cuda_job, job, lambda arg, out, exc: self._commit_done(ident, msg.id, res, exc))
            return None
        if len(frames) != len(res.slots):
            raise RequestError(E.BAD_PAYLOAD, f"commit of reservation {res.id} needs {len(res.slots)} payload "
                               f"frames ({msg.format}), got {len(frames)}")
        if msg.format == "raw":
            for i, (f, (c, g, e)) in enumerate(zip(frames, res.slots, strict=True)):
                if len(f) != e.length:
                    raise RequestError(E.BAD_PAYLOAD, f"payload frame {i} (chunk {c}, group {g}) is {len(f)} B; "
                                       f"the object is {e.length} B")
        res.committing = True
        self._submit(self._commit_job, (res, msg.format, frames),
                     lambda arg, out, exc: self._commit_done(ident, msg.id, arg[0], exc))
        return None

    def _commit_job(self, arg) -> None:
        res, fmt, frames = arg
        for f, (_, _, e) in zip(frames, res.slots, strict=True):
            dst = self.arena.view(e.offset, e.length)
            if fmt == "raw":
                # numpy releases the GIL for the copy, so the loop keeps serving meanwhile
                np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(f.buffer, np.uint8))
            else:
                copy_tensor_into(decode_tensor(fmt, f.buffer), dst)

    def _commit_done(self, ident: bytes, req_id: int, res: Reservation, exc: BaseException | None) -> None:
        if res.dead:
            self._free_slots(res, quarantine=False)
            return
        if exc is not None:
            self._reservations.pop(res.id, None)
            self._engines[res.engine].reservations.discard(res.id)
            self._free_slots(res, quarantine=False)
            self._send_error(ident, req_id, E.BAD_PAYLOAD, f"reservation {res.id} aborted: {exc}")
            return
        self._send(ident, req_id, self._finish_commit(res))

    def _finish_commit(self, res: Reservation) -> P.Committed:
        nbytes = 0
        for _, _, e in res.slots:
            self.l1.make_ready(e)
            nbytes += e.length
        self._reservations.pop(res.id, None)
        self._engines[res.engine].reservations.discard(res.id)
        self.counters["objects_committed"] += len(res.slots)
        self.counters["bytes_committed"] += nbytes
        self._spill_ahead()
        return P.Committed(objects=len(res.slots), bytes=nbytes)

    def _abort(self, ident: bytes, msg: P.AbortStore, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        res = self._reservation(eng, msg.reservation)
        del self._reservations[res.id]
        eng.reservations.discard(res.id)
        self._free_slots(res, quarantine=False)
        self.counters["objects_aborted"] += len(res.slots)
        return P.Done(count=len(res.slots)), []

    def _free_slots(self, res: Reservation, quarantine: bool) -> None:
        for _, _, e in res.slots:
            if quarantine:
                # A client we declared gone may still be DMA-ing into the slot: hide the entry now, reuse later.
                self.l1.detach(e)
                self._quarantine.append((time.monotonic() + self.config.quarantine_s, e.offset, e.length))
            else:
                self.l1.drop(e)

    # ---- retrieve, release, sessions -------------------------------------------------------------

    def _lease(self, eng: EngineInfo, lid: int) -> Lease:
        lease = self._leases.get(lid)
        if lease is None or lease.engine != eng.id:
            raise RequestError(E.UNKNOWN_LEASE, f"lease {lid} is not held by engine {eng.id} "
                               "(never made, already released, or reclaimed)")
        return lease

    def _retrieve(self, ident: bytes, msg: P.Retrieve, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        lease = self._lease(eng, msg.lease)
        if msg.format == "shm":
            raise RequestError(E.BAD_REQUEST, "shm engines read the arena at the lookup's offsets; retrieve "
                               "sends payload frames only for raw, pickle and torch_save")
        if msg.format == "cuda_ipc":
            job = self._cuda_copy(eng, "scatter", [(loc.chunk, loc.group, e) for loc, e in
                                                   zip(lease.locs, lease.entries, strict=True)], msg.blocks)
            self._submit(self._cuda_job, job,
                         lambda arg, out, exc: self._send(ident, msg.id, P.Retrieved(objects=lease.locs))
                         if exc is None else self._send_error(ident, msg.id, E.BAD_REQUEST, f"copy failed: {exc}"))
            return None
        if msg.format == "raw":
            # zero-copy: frames point into the arena; the lease's pins keep the bytes still until release
            return P.Retrieved(objects=lease.locs), [self.arena.view(e.offset, e.length) for e in lease.entries]
        dtypes = [eng.layout.groups[loc.group].dtype for loc in lease.locs]
        self._submit(self._encode_job, (lease, msg.format, dtypes),
                     lambda arg, out, exc: self._send(ident, msg.id, P.Retrieved(objects=lease.locs), out)
                     if exc is None else self._send_error(ident, msg.id, E.INTERNAL, f"encode failed: {exc}"))
        return None

    def _encode_job(self, arg) -> list[bytes]:
        lease, fmt, dtypes = arg
        return [encode_tensor(fmt, bytes_to_tensor(self.arena.view(e.offset, e.length), dt))
                for e, dt in zip(lease.entries, dtypes, strict=True)]

    def _unpin_lease(self, lease: Lease) -> None:
        for e in lease.entries:
            e.pins -= 1

    def _release(self, ident: bytes, msg: P.Release, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        lease = self._lease(eng, msg.lease)
        self._unpin_lease(self._leases.pop(lease.id))
        eng.leases.discard(lease.id)
        return P.Done(count=len(lease.entries)), []

    def _end_session(self, ident: bytes, msg: P.EndSession, frames: list):
        _no_frames(msg, frames)
        eng = self._engine(msg.engine)
        count = 0
        for lid in [i for i in eng.leases if self._leases[i].request == msg.request]:
            self._unpin_lease(self._leases.pop(lid))
            eng.leases.discard(lid)
            count += 1
        for rid in [i for i in eng.reservations if self._reservations[i].request == msg.request]:
            res = self._reservations[rid]
            if res.committing:
                continue  # its commit answers on its own
            del self._reservations[rid]
            eng.reservations.discard(rid)
            self._free_slots(res, quarantine=False)
            count += 1
        return P.Done(count=count), []

    # ---- admin -----------------------------------------------------------------------------------

    def _stats(self, ident: bytes, msg: P.Stats, frames: list):
        _no_frames(msg, frames)
        c: dict[str, int | float] = dict(self.counters)
        c.update(self.l1.usage())
        c.update(engines=len(self._engines), leases=len(self._leases), reservations=len(self._reservations),
                 parked=len(self._parked), uptime_s=time.monotonic() - self.started)
        if self.l2 is not None:
            c.update({f"l2_{k}": v for k, v in self.l2.stats().items()})
        return P.StatsResult(counters=c), []

    def _clear(self, ident: bytes, msg: P.Clear, frames: list):
        _no_frames(msg, frames)
        ns = None if msg.engine is None else self._engine(msg.engine).ns
        count = 0
        for e in self.l1.entries():
            if (ns is None or e.ns == ns) and e.evictable:
                self.l1.drop(e)
                count += 1
        if self.l2 is not None:
            count += self.l2.clear(ns)
        return P.Done(count=count), []

    def _health(self, ident: bytes, msg: P.Health, frames: list):
        _no_frames(msg, frames)
        return P.HealthResult(status="ok", version=__version__, uptime_s=time.monotonic() - self.started,
                              pid=os.getpid()), []

    # ---- L2 spills -------------------------------------------------------------------------------

    def _start_evicting_spill(self, e: Entry) -> None:
        self._spills_inflight += 1
        self._submit(self._spill_job, e, self._spill_done)

    def _spill_job(self, e: Entry) -> None:
        self.l2.put(e.key, e.group, e.ns, self.arena.view(e.offset, e.length))

    def _spill_done(self, e: Entry, res, exc: BaseException | None) -> None:
        self._spills_inflight -= 1
        if exc is None:
            self.counters["l2_spills"] += 1
            self.counters["l2_spill_bytes"] += e.length
        else:
            self.counters["l2_spill_failures"] += 1
        self.l1.spill_finished(e, ok=exc is None)

    def _spill_ahead(self) -> None:
        if self.l2 is None:
            return
        for e in self.l1.spill_ahead(self.config.spill_watermark, self.config.io_threads, self._spills_inflight):
            self._start_evicting_spill(e)


class _LookupOp:
    """A lookup that may wait for L2 prefetches; it pins what it needs as soon as it is in L1."""

    def __init__(self, srv: RequestHandlers, ident: bytes, msg: P.Lookup, eng: EngineInfo, keys: list[bytes]):
        self.srv, self.ident, self.msg, self.eng, self.keys = srv, ident, msg, eng, keys
        self.pinned: dict[tuple[bytes, int], Entry] = {}
        self.missing: set[tuple[bytes, int]] = set()

    def _pin(self, e: Entry) -> None:
        old = self.pinned.get(e.oid)
        if old is e:
            return
        if old is not None:
            old.pins -= 1  # dropped when its prefetch failed; the object is back in another slot
        e.pins += 1
        self.pinned[e.oid] = e

    def step(self) -> bool:
        srv, eng, keys, msg = self.srv, self.eng, self.keys, self.msg
        if srv._engines.get(eng.id) is not eng:
            self._unpin(set())
            return True
        while True:
            n = srv._hit(eng, keys, msg.policy, self.missing)
            needed = srv._needed(eng, keys, n, msg.policy, msg.skip_chunks)
            waiting = restart = False
            # Pin what is already in L1 before any prefetch allocates: a prefetch for this lookup must
            # never evict an object this same lookup needs further down its list.
            for c, g in needed:
                e = srv.l1.get((keys[c], g))
                if e is not None and e.state is not State.RESERVED:
                    self._pin(e)
            for c, g in needed:
                oid = (keys[c], g)
                e = srv.l1.get(oid)
                if e is None:
                    r = srv._start_prefetch(keys[c], g, eng.ns, eng.object_bytes[g])
                    if r is None:  # no room to bring it in: treat as a miss at this length
                        self.missing.add(oid)
                        restart = True
                        break
                    waiting = True
                    if isinstance(r, Entry):
                        self._pin(r)
                    continue
                self._pin(e)
                waiting = waiting or e.state is State.LOADING
            if not restart:
                break
        if waiting:
            return False
        wanted = {(keys[c], g) for c, g in needed}
        self._unpin(wanted)
        entries = [self.pinned[(keys[c], g)] for c, g in needed]
        locs = [P.ObjectLoc(c, g, e.offset, e.length) for (c, g), e in zip(needed, entries, strict=True)]
        for e in entries:
            srv.l1.touch(e)
        lid = 0
        if entries:
            lid = srv._new_id()
            srv._leases[lid] = Lease(lid, eng.id, msg.request, entries, locs)
            eng.leases.add(lid)
        srv.counters["hit_chunks"] += n
        srv._send(self.ident, msg.id, P.LookupResult(hit_chunks=n, lease=lid, objects=locs))
        return True

    def _unpin(self, keep: set) -> None:
        for oid in [o for o in self.pinned if o not in keep]:
            self.pinned.pop(oid).pins -= 1


class _PrepareOp:
    """A store reservation that may wait for spills to free L1 space."""

    def __init__(self, srv: RequestHandlers, ident: bytes, msg: P.PrepareStore, eng: EngineInfo, keys: list[bytes]):
        self.srv, self.ident, self.msg, self.eng, self.keys = srv, ident, msg, eng, keys
        self.todo = list(msg.objects)
        self.slots: list[tuple[int, int, Entry]] = []
        self.present: list[tuple[int, int]] = []
        self.refused: list[P.Refusal] = []

    def step(self) -> bool:
        srv, eng = self.srv, self.eng
        if srv._engines.get(eng.id) is not eng:
            for _, _, e in self.slots:
                srv.l1.drop(e)
            return True
        while self.todo:
            c, g = self.todo[0]
            key, length = self.keys[c], eng.object_bytes[g]
            if srv.l1.get((key, g)) is not None or (srv.l2 is not None and srv.l2.length(key, g) == length):
                self.present.append((c, g))  # delta-aware: no bytes move for what the server holds
            else:
                r = srv.l1.reserve(key, g, eng.ns, length)
                if r == WAIT:
                    return False
                if r is None:
                    self.refused.append(P.Refusal(c, g, f"no space: L1 holds {srv.l1.alloc.size} B, "
                                                  f"{srv.l1.alloc.free_bytes} B free, the rest pinned "
                                                  "or being written"))
                else:
                    self.slots.append((c, g, r))
            self.todo.pop(0)
        rid = 0
        if self.slots:
            rid = srv._new_id()
            srv._reservations[rid] = Reservation(rid, eng.id, self.msg.request, self.slots)
            eng.reservations.add(rid)
        srv.counters["objects_skipped_present"] += len(self.present)
        srv.counters["objects_refused"] += len(self.refused)
        slots = [P.ObjectLoc(c, g, e.offset, e.length) for c, g, e in self.slots]
        srv._send(self.ident, self.msg.id, P.Prepared(reservation=rid, slots=slots, present=self.present,
                                                      refused=self.refused))
        return True
