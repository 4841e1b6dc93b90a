"""The object store: L1 and L2 state of every (chunk, group) object, and the only place it changes.

It owns the L1 table (states, pins, LRU queues), the L2 adapter, the quarantine of reclaimed slots,
spills (evicting and ahead of need, in batches) and prefetches from L2. Handlers ask it questions
and give it orders; they never touch an Entry's fields themselves.

Every object is of the namespace it was stored under, and every question is asked for one namespace: an
object of another is neither available, nor present, nor read back from L2 for the asker (a client may send
another namespace's keys under its own registration; docs/trust-model.md). Such objects are collected in the
caller's `foreign` set, so that its request is counted once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import Enum
from operator import attrgetter
from typing import TypeGuard

from hybridkv.memory.arena import Arena
from hybridkv.server.books.config import ServerConfig
from hybridkv.server.books.counters import Counters
from hybridkv.server.books.l1 import Entry, L1Cache, NoSlot, ObjectKey, State
from hybridkv.server.books.loans import Loans
from hybridkv.server.l2.base import L2Adapter
from hybridkv.server.machinery.table import ObjectKeys, SegmentedSet
from hybridkv.server.machinery.workers import Workers

log = logging.getLogger("hybridkv.server")

SPILL_BATCH = 64          # objects per spill job: one hand-off to a worker, not one per tiny object
# ... and bytes per spill job: a job of large objects ends early, so a flush or a burst of spills keeps
# every I/O thread writing (64 Qwen3.6-27B objects in one job would leave the other threads idle).
SPILL_BATCH_BYTES = 8 << 20
SPILL_RETRY_S = 10.0      # an object whose L2 write failed is tried again after this long
FAILURE_LOG_EVERY_S = 10.0
_state, _ns = attrgetter("state"), attrgetter("ns")


def all_ready(entries: list[Entry | None], ns: bytes | None) -> TypeGuard[list[Entry]]:
    """Whether every one of these entries (`L1.get_many`'s) is READY in L1, and of namespace `ns` unless it is None
    (a piece of a lookup's or prefetch's prefix in the common case: pinned and answered at once). count() compares
    by identity first and runs in C; a set of states would hash each Enum member in Python."""
    return None not in entries and list(map(_state, entries)).count(State.READY) == len(entries) \
        and (ns is None or list(map(_ns, entries)).count(ns) == len(entries))


class Held(Enum):
    """Whose an object is, for a store that asks whether it may skip it (`ObjectStore.held`)."""
    MINE = 1      # in L1 (even being written) or in L2, of the asker's namespace and length: skip it
    OTHER = 2     # held under another namespace (or another length): neither skipped nor written over
    NONE = 3      # held by nobody: store it


def spill_batches(entries: list[Entry]) -> Iterator[list[Entry]]:
    """`entries` in order, cut into jobs of at most SPILL_BATCH objects that stop once they hold
    SPILL_BATCH_BYTES: many tiny objects share one hand-off, large ones spread over every I/O thread."""
    batch: list[Entry] = []
    size = 0
    for e in entries:
        batch.append(e)
        size += e.length
        if len(batch) == SPILL_BATCH or size >= SPILL_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class ObjectStore:
    """L1 + L2 objects of every namespace."""

    def __init__(self, config: ServerConfig, arena: Arena, l2: L2Adapter | None, workers: Workers,
                 counters: Counters, clock: Callable[[], float] = time.monotonic):
        self.config = config
        # the quarantine's clock: the server's running time (Sessions.now), as the client timeout's. By the wall
        # clock, a server stopped longer than the quarantine freed a reclaimed engine's slots at its first tick
        # after, though the engine had had no running time of the server's to finish its late copies.
        self._clock = clock
        self.arena = arena
        self.l2 = l2
        self._workers = workers
        self._counters = counters
        has_l2 = (lambda e: l2.length(e.key, e.group, e.ns) == e.length) if l2 is not None else None
        self.l1 = L1Cache(arena, config.eviction, self._spill if l2 is not None else None, has_l2)
        self.get: Callable[[ObjectKey], Entry | None] = self.l1.get  # the L1 table's entry of an object, or None
        # objects whose bytes a reply frame or a worker still reads: their slots kept until given back (loans.py)
        self.loans = Loans(arena, self.l1, workers.wake)
        self._quarantine: deque[tuple[float, int, int]] = deque()  # (until, offset, length), in time order
        self._held_pins: deque[tuple[float, list[Entry]]] = deque()  # (until, entries) of reclaimed leases
        self._spills_inflight = 0
        self._last_failure_log = 0.0
        self._failures_unlogged = 0
        self._dropped_logged = 0
        self.last_spill_error = ""
        self._stopping = False

    # ---- questions ---------------------------------------------------------------------------------

    @property
    def probes_l2(self) -> bool:
        """Whether `probe_l2` asks the L2 anything (a remote L2's index)."""
        return self.l2 is not None and type(self.l2).probe is not L2Adapter.probe

    def probe_l2(self, keys: list[bytes], groups: int) -> None:
        """Let a remote L2 learn, in one round trip, which of these objects it holds before a lookup or a
        store asks for them one by one (a no-op for adapters whose index is local)."""
        if self.l2 is None or type(self.l2).probe is L2Adapter.probe:
            return
        self.l2.probe([(k, g) for k in keys for g in range(groups) if self.l1.get((k, g)) is None])

    def available_prefix(self, keys: list[bytes], groups: Sequence[int], lengths: list[int],
                         missing: ObjectKeys, ns: bytes, foreign: ObjectKeys) -> int:
        """How many leading keys have the object of every one of `groups` available to a lookup of namespace
        `ns`: READY or LOADING in L1, or in L2, of namespace `ns` and length `lengths[group]`, and not in
        `missing`; an object that is held but not so goes into `foreign`. One loop, no call per object: it is
        the lookup's hit rule over every chunk of a long prompt."""
        if not missing:  # the common full hit, every object READY in L1 in this namespace: asked in C
            ready = self.l1.ready_keys.get
            for g in groups:
                r = ready((ns, g))
                if r is None or not r.issuperset(keys):
                    break
            else:
                return len(keys)
        get, l2, reserved = self.l1.get, self.l2, State.RESERVED
        if type(missing) is SegmentedSet:
            missing = missing.view()  # a plain set unless it outgrew one segment: `in` asked in C
        for n, k in enumerate(keys):
            for g in groups:
                oid = (k, g)
                e = get(oid)
                if e is not None:
                    if e.ns != ns or e.length != lengths[g]:  # a compare per object, on this slow path only
                        foreign.add(oid)
                        return n
                    if e.state is reserved:
                        return n
                elif l2 is None or l2.length(k, g, ns) != lengths[g]:
                    if l2 is not None and l2.length(k, g) is not None:  # held, not ours: once per call, at the end
                        foreign.add(oid)
                    return n
                if missing and oid in missing:
                    return n
        return len(keys)

    def held(self, oid: ObjectKey, ns: bytes, length: int) -> Held:
        """Whether a store of namespace `ns` may skip this object (of `length` bytes), must leave it alone, or
        may write it."""
        e = self.l1.get(oid)
        if e is not None:
            return Held.MINE if e.ns == ns and e.length == length else Held.OTHER
        if self.l2 is None:
            return Held.NONE
        if self.l2.length(*oid, ns) == length:
            return Held.MINE
        return Held.NONE if self.l2.length(*oid) is None else Held.OTHER

    def full_reason(self) -> str:
        a = self.l1.alloc
        return (f"no space: L1 holds {a.size} B, {a.free_bytes} B free, the rest pinned, reserved or "
                "being read from L2")

    # ---- orders ------------------------------------------------------------------------------------

    def reserve(self, oid: ObjectKey, ns: bytes, length: int) -> Entry | NoSlot:
        return self.l1.reserve(oid[0], oid[1], ns, length)

    def publish(self, entries: list[Entry]) -> None:
        """Written entries become READY (visible to lookups)."""
        for e in entries:
            self.l1.make_ready(e)
        self.spill_ahead()

    def make_ready(self, e: Entry) -> None:
        """One written entry becomes READY (a publication in turns; `spill_ahead` after its pieces)."""
        self.l1.make_ready(e)

    def discard(self, entries: list[Entry], quarantine: bool) -> None:
        """Drop unpublished entries; quarantined slots are reused only after the quarantine time."""
        for e in entries:
            if e.gone:
                continue
            if quarantine:
                # A client we declared gone may still be DMA-ing into the slot: hide the entry now, reuse later.
                self.l1.detach(e)
                self._quarantine.append((self._clock() + self.config.quarantine_s, e.offset, e.length))
            else:
                self.l1.drop(e)

    def quarantine_pins(self, entries: list[Entry]) -> None:
        """Keep one pin of each of a reclaimed engine's leased objects for the quarantine time: an engine judged gone
        may still read them through its mapping of the arena, so their slots are not written over meanwhile (the
        objects stay readable by everyone). `pins_out_of_quarantine` gives them back."""
        if entries:
            self._held_pins.append((self._clock() + self.config.quarantine_s, entries))

    def pins_out_of_quarantine(self, ran: float) -> list[Entry]:
        """The pins `quarantine_pins` kept whose time is up at `ran` (the quarantine's clock), for the caller to
        let go."""
        out: list[Entry] = []
        while self._held_pins and self._held_pins[0][0] <= ran:
            out += self._held_pins.popleft()[1]
        return out

    def pin(self, e: Entry) -> None:
        self.l1.pin(e)

    def unpin(self, e: Entry) -> None:
        self.l1.unpin(e)

    def pin_all(self, entries: Iterable[Entry]) -> None:
        self.l1.pin_all(entries)

    def unpin_all(self, entries: Iterable[Entry]) -> None:
        self.l1.unpin_all(entries)

    def clear(self, ns: bytes | None) -> int:
        """Drop every evictable object of namespace `ns` (of every namespace when None) from L1 and L2."""
        return sum(self.clear_l1_steps(ns)) + (self.l2.clear(ns) if self.l2 is not None else 0)

    def clear_l1_steps(self, ns: bytes | None) -> Iterator[int]:
        """The L1 part of `clear` in pieces, each yielding how many objects it dropped: a table shard's snapshot at a
        time, in pieces of table.PIECE entries. Between two pieces the caller may serve other requests: an entry is
        dropped only if, when its piece comes, it is still the table's, of namespace `ns` and evictable; an object
        stored after its piece passed stays."""
        for piece in self.l1.pieces():
            n = 0
            for e in piece:
                if not e.gone and (ns is None or e.ns == ns) and e.evictable:  # not gone: still the table's
                    self.l1.drop(e)
                    n += 1
            yield n

    def tick(self, now: float, ran: float) -> None:
        """Free quarantined slots whose time is up at `ran` (the quarantine's clock); retry L2 writes that failed a
        while ago (`now`, monotonic)."""
        while self._quarantine and self._quarantine[0][0] <= ran:
            _, offset, length = self._quarantine.popleft()
            self.l1.alloc.free(offset, length)
        if self.l1.retry_stuck(now - SPILL_RETRY_S):
            self.spill_ahead()
        self._log_failures(now, force=False)

    def entries(self) -> Iterator[Entry]:
        return self.l1.entries()

    # ---- L2 prefetch -------------------------------------------------------------------------------

    def prefetch(self, oid: ObjectKey, ns: bytes, length: int) -> Entry | NoSlot:
        """Reserve a slot and read an L2 object into it; the entry is LOADING until the read ends."""
        r = self.l1.reserve(oid[0], oid[1], ns, length, state=State.LOADING)
        if isinstance(r, Entry):
            l2 = self.l2
            assert l2 is not None
            e = r
            if self._workers.submit(lambda: l2.get_into(e.key, e.group, self.arena.view(e.offset, e.length), e.ns),
                                    lambda ok, exc: self._prefetch_done(e, ok, exc)):
                self._counters.l2_prefetches += 1
            else:
                self.l1.drop(e)  # shutting down
                return NoSlot.FULL
        return r

    def _prefetch_done(self, e: Entry, ok: bool | None, exc: BaseException | None) -> None:
        if ok and exc is None:
            self.l1.loaded(e)
            self._counters.l2_prefetch_bytes += e.length
        else:
            # a bad or vanished L2 file is a miss: the lookup recomputes its hit without it
            self._counters.l2_prefetch_failures += 1
            if exc is not None:
                log.warning("L2 read of an object failed: %s: %s", type(exc).__name__, exc)
            self.l1.drop(e)

    # ---- L2 spills ---------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Whether the server is shutting down (a Clear's L2 part stops at its next piece)."""
        return self._stopping

    def shutting_down(self) -> None:
        """From now on no spill starts by itself: the pool is about to close, and a spill that finishes would
        start the next, which the closed pool refuses (a write that never ran is no failed write). Loans given
        back from now on wake nobody: the wake-up pipe is about to close."""
        self._stopping = True
        self.loans.close()

    def spill_ahead(self) -> None:
        """Keep the spill watermark: copy the oldest dirty objects to L2, a batch per worker job."""
        if self.l2 is None or self._stopping:
            return
        room = self.config.io_threads - self._spills_inflight
        while room > 0:
            batch = self.l1.spill_ahead(self.config.spill_watermark, SPILL_BATCH, SPILL_BATCH_BYTES)
            if not batch:
                return
            self._spill(batch)
            room -= 1

    def flush(self) -> None:
        """Write every dirty object to L2 (shutdown with --flush-on-exit)."""
        if self.l2 is None:
            return
        for batch in spill_batches(self.l1.take_unspilled()):
            self._spill(batch)

    def _spill(self, batch: list[Entry]) -> None:
        l2 = self.l2
        assert l2 is not None

        def job() -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for e in batch:
                try:
                    l2.put(e.key, e.group, e.ns, self.arena.view(e.offset, e.length))
                    out.append(None)
                except Exception as exc:  # noqa: BLE001 - each object's fate is reported on its own
                    out.append(exc)
            return out

        self._spills_inflight += 1
        if not self._workers.submit(job, lambda res, exc: self._spill_done(batch, res, exc)):
            # shutting down: never written, so neither a failure to count nor a reason to start the next one
            self._spills_inflight -= 1
            for e in batch:
                self.l1.spill_finished(e, ok=False)

    def _spill_done(self, batch: list[Entry], results: list[BaseException | None] | None,
                    exc: BaseException | None) -> None:
        self._spills_inflight -= 1
        for i, e in enumerate(batch):
            err = exc if results is None else results[i]
            if err is None:
                self._counters.l2_spills += 1
                self._counters.l2_spill_bytes += e.length
            else:
                self._counters.l2_spill_failures += 1
                self._failures_unlogged += 1
                self.last_spill_error = f"{type(err).__name__}: {err}"
            self.l1.spill_finished(e, ok=err is None)
        self._log_failures(time.monotonic(), force=False)
        self.spill_ahead()

    def _log_failures(self, now: float, force: bool) -> None:
        """Rate-limited: one line per interval says how many writes failed and what became of the objects."""
        dropped = self.l1.dropped_unspilled - self._dropped_logged
        if (self._failures_unlogged or dropped) and (force or now - self._last_failure_log >= FAILURE_LOG_EVERY_S):
            log.error("%d L2 writes failed (last: %s); %d objects stay in L1 and are retried every %gs; %d objects "
                      "were dropped from L1 without an L2 copy to make room (%d since start)",
                      self._failures_unlogged, self.last_spill_error, self.l1.stuck_objects, SPILL_RETRY_S,
                      dropped, self.l1.dropped_unspilled)
            self._failures_unlogged = 0
            self._dropped_logged = self.l1.dropped_unspilled
            self._last_failure_log = now

    def close(self) -> None:
        self._log_failures(time.monotonic(), force=True)
        if self.l2 is not None:
            self.l2.close()

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.l1.usage())
        out["l1_quarantined_slots"] = len(self._quarantine)
        out["l1_lent_objects"] = self.loans.objects
        if self.l2 is not None:
            out.update({f"l2_{k}": v for k, v in self.l2.stats().items()})
        return out
