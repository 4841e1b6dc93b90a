"""Lookup: the hit rule, pins for the hit's objects, and L2 -> L1 prefetch of those not in L1."""

from __future__ import annotations

from hybridkv import protocol as P
from hybridkv.policy import resume_bytes, resume_objects
from hybridkv.server.books.l1 import Entry, NoSlot, ObjectKey, State
from hybridkv.server.books.records import Engine
from hybridkv.server.ops.context import Answer, Context, Frames, RequestError, check_keys, no_frames
from hybridkv.server.ops.hitrule import count_foreign, count_hit, hit_length
from hybridkv.server.ops.lookup_turns import TurnedLookupOp
from hybridkv.server.ops.turns import BIG_OBJECTS

E = P.ErrorCode


def resume_request(ctx: Context, ident: bytes, msg: P.Lookup | P.Prefetch,
                   frames: Frames) -> tuple[Engine, list[bytes]]:
    """The engine and checked keys of a request that resumes a prefix (Lookup, Prefetch), its skip_chunks
    checked too."""
    no_frames(msg, frames)
    eng = ctx.sessions.engine(ident, msg.engine)
    keys = check_keys(msg.keys, ctx.config.max_keys)
    if msg.skip_chunks < 0:
        raise RequestError(E.BAD_REQUEST, f"skip_chunks must be >= 0, got {msg.skip_chunks}")
    return eng, keys


def lookup(ctx: Context, ident: bytes, msg: P.Lookup, frames: Frames) -> Answer:
    eng, keys = resume_request(ctx, ident, msg, frames)
    ctx.counters.lookups += 1
    ctx.counters.lookup_chunks += len(keys)
    ctx.counters.lookup_tokens += len(keys) * eng.chunk_tokens
    if len(keys) * len(eng.layout.groups) > BIG_OBJECTS:  # in turns: other clients are answered meanwhile
        if msg.pin:
            ctx.sessions.lease_room(eng)
        big = TurnedLookupOp(ctx, ident, msg, eng, keys)
        if not big.step():
            ctx.park(big)
        return None
    ctx.objects.probe_l2(keys, len(eng.layout.groups))
    if not msg.pin:
        foreign: set[ObjectKey] = set()
        n = hit_length(ctx, eng, keys, msg.policy, set(), foreign)
        count_hit(ctx, eng, n, 0, probe=True)
        count_foreign(ctx, foreign)
        return P.LookupResult(hit_chunks=n, lease=0, objects=[]), []
    ctx.sessions.lease_room(eng)
    op = LookupOp(ctx, ident, msg, eng, keys)
    if not op.step():
        ctx.park(op)
    return None


class LookupOp:
    """A lookup that may wait for L2 prefetches; it pins what it needs as soon as it is in L1."""

    ends_with_session = True  # while parked, an EndSession of its request waits for it (retrieve.end_session)
    answered = False  # it leaves the parked list as it answers
    ended_by: tuple | list = ()  # the EndSession answers waiting for it (retrieve.end_session sets it)

    def __init__(self, ctx: Context, ident: bytes, msg: P.Lookup, eng: Engine, keys: list[bytes]):
        self.ctx, self.ident, self.req_id, self.msg, self.eng, self.keys = ctx, ident, msg.id, msg, eng, keys
        self.pinned: dict[ObjectKey, Entry] = {}
        self.missing: set[ObjectKey] = set()
        self.foreign: set[ObjectKey] = set()  # objects of another namespace under its keys (counted once)
        self.loading: list[Entry] = []  # prefetches this op waits for
        self.waited = False  # counted once in lookup_l2_waits
        self.from_l2: set[int] = set()  # chunks with an object this lookup waited on an L2 read for (tier l2)

    def _pin(self, e: Entry) -> None:
        old = self.pinned.get(e.oid)
        if old is e:
            return
        if old is not None:
            self.ctx.objects.unpin(old)  # dropped when its prefetch failed; the object is back in another slot
        self.ctx.objects.pin(e)
        self.pinned[e.oid] = e

    def step(self) -> bool:
        ctx, eng, keys, msg = self.ctx, self.eng, self.keys, self.msg
        if ctx.sessions.engines.get(eng.id) is not eng:
            self._unpin(set())
            ctx.fail(self.ident, self.req_id, E.UNKNOWN_ENGINE, f"engine {eng.id} was unregistered or reclaimed "
                     "while this lookup waited")
            for w in self.ended_by:
                w.finished(self, False)
            return True
        # Cheap while prefetches are still running: re-running the hit rule per completion would cost
        # O(keys) for every finished read, O(keys^2) for a large lookup.
        while self.loading and (self.loading[-1].state is not State.LOADING or self.loading[-1].gone):
            self.loading.pop()
        if self.loading:
            return False
        objects = ctx.objects
        n = hit_length(ctx, eng, keys, msg.policy, self.missing, self.foreign)
        needed = resume_objects(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens)
        if not self.pinned and not self.missing:
            # the common case, every needed object READY in L1: pin them all and answer in one pass
            ready = objects.ready([(keys[c], g) for c, g in needed])
            if ready is not None:
                objects.pin_all(ready)
                self._answer(n, needed, ready)
                return True
        while True:
            restart = False
            # Pin what is already in L1 before any prefetch allocates: a prefetch for this lookup must
            # never evict an object this same lookup needs further down its list.
            for c, g in needed:
                e = objects.get((keys[c], g))
                if e is not None and e.state is not State.RESERVED:
                    self._pin(e)
            for c, g in needed:
                oid = (keys[c], g)
                e = objects.get(oid)
                if e is None:
                    r = objects.prefetch(oid, eng.ns, eng.object_bytes[g])
                    if isinstance(r, NoSlot):
                        if r is NoSlot.FULL:  # no room to bring it in: treat as a miss at this length
                            self.missing.add(oid)
                            restart = True
                            break
                        continue  # spills will free room: this op is stepped again when they finish
                    self._pin(r)
                    self.loading.append(r)
                    self.from_l2.add(c)
                    continue
                if e.state is State.LOADING:
                    self.loading.append(e)
                    self.from_l2.add(c)
            if not restart:
                break
            n = hit_length(ctx, eng, keys, msg.policy, self.missing, self.foreign)  # a miss: the hit is shorter
            needed = resume_objects(eng.layout, msg.policy, n, msg.skip_chunks, eng.chunk_tokens)
        if self.loading or any((keys[c], g) not in self.pinned for c, g in needed):
            if self.loading and not self.waited:
                self.waited = True
                ctx.counters.lookup_l2_waits += 1
            return False
        wanted = {(keys[c], g) for c, g in needed}
        self._unpin(wanted)
        self._answer(n, needed, [self.pinned[(keys[c], g)] for c, g in needed])
        return True

    def _answer(self, n: int, needed: list[tuple[int, int]], entries: list[Entry]) -> None:
        """Lease the pinned `entries` (one per needed object; they move to the young end of LRU when
        released) and answer with their places in the arena."""
        locs = [P.ObjectLoc(c, g, e.offset, e.length) for (c, g), e in zip(needed, entries, strict=True)]
        lid = 0
        if entries:
            lid = self.ctx.sessions.add_lease(self.eng, self.msg.request, entries, locs).id
        eng = self.eng
        count_hit(self.ctx, eng, n, sum(1 for c in self.from_l2 if c < n), probe=False)
        count_foreign(self.ctx, self.foreign)
        self.ctx.counters.bytes_leased += resume_bytes(eng.layout, self.msg.policy, n, self.msg.skip_chunks,
                                                       eng.object_bytes, eng.chunk_tokens)
        self.ctx.send(self.ident, self.req_id, P.LookupResult(hit_chunks=n, lease=lid, objects=locs), ())
        if self.ended_by:  # parked, and its session ended after it was asked: the lease is released at once
            if lid:
                lease = self.ctx.sessions.leases[lid]
                self.ctx.sessions.close_lease(lease)
                self.ctx.objects.unpin_all(lease.entries)
            for w in self.ended_by:
                w.finished(self, bool(lid))

    def _unpin(self, keep: set[ObjectKey]) -> None:
        for oid in [o for o in self.pinned if o not in keep]:
            self.ctx.objects.unpin(self.pinned.pop(oid))
