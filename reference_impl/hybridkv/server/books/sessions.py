"""Sessions: registered engines, their store reservations and their read leases.

Each belongs to the connection (ZMQ routing id) that made it: a request naming an engine registered by
another connection is answered as if the engine did not exist. Ids are random 63-bit numbers, so one
client cannot guess another's. This module keeps the books only; freeing slots and unpinning objects
is the object store's job (see handlers in admin.py / retrieve.py / store.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from hybridkv.model.layout import ModelLayout
from hybridkv.server.books.counters import Counters
from hybridkv.server.books.errors import RequestError
from hybridkv.server.books.fences import Fences
from hybridkv.server.books.l1 import Entry
from hybridkv.server.books.records import Engine, Lease, Reservation, Slot
from hybridkv.wire import protocol as P

E = P.ErrorCode
log = logging.getLogger("hybridkv.server")

# A loop turn (its poll waits 200 ms at most) longer than this: the server did not run (stopped, a VM paused, swapped
# out), and what its clients sent meanwhile waited unread; no engine's silence counts that time.
STALLED_S = 1.0


@dataclass(slots=True)
class SessionLimits:
    max_engines: int
    max_engines_per_client: int  # one connection's share of max_engines
    max_leases: int         # per engine
    max_reservations: int   # per engine


class Sessions:
    """Every live engine, reservation and lease, indexed by id."""

    def __init__(self, limits: SessionLimits, client_timeout_s: float, fences: Fences, counters: Counters):
        self.limits = limits
        self.fences = fences  # where each reservation's fence word comes from and goes back to
        self.client_timeout_s = client_timeout_s
        self.engines: dict[int, Engine] = {}
        self._per_client: dict[bytes, int] = {}  # engines registered by each connection
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self.released_objects = 0  # objects of every lease and reservation closed so far (heap.HeapTrim reads it)
        self.counters = counters
        self.unscheduled_s = 0.0  # time the loop did not run (`ran`): no engine's silence counts it
        self.ran_at = time.monotonic()  # when the loop last ran (`ran`)

    def now(self) -> float:
        """The time the server ran: the monotonic clock less every stretch the loop was not running. An engine is
        silent by this clock, so a server that was stopped (SIGSTOP, a VM pause, swap) while its engines kept
        heartbeating, their heartbeats queued unread, does not judge them silent when it runs again."""
        return time.monotonic() - self.unscheduled_s

    def ran(self, now: float) -> float:
        """The loop runs at `now` (monotonic); returns `Sessions.now` then. A gap of more than STALLED_S since it last
        ran is time it did not run, its clients' heartbeats waiting unread: nobody's silence counts it."""
        gap = now - self.ran_at
        self.ran_at = now
        if gap > STALLED_S:
            self.unscheduled_s += gap
            self.counters.loop_stalls += 1
            log.warning("the server did not run for %.1fs (stopped, paused or swapped out): engines are judged silent "
                        "by the time it ran", gap)
        return now - self.unscheduled_s

    def _new_id(self) -> int:
        while True:
            i = secrets.randbits(63)
            if i and i not in self.engines and i not in self.reservations and i not in self.leases:
                return i

    def engine(self, ident: bytes, engine_id: int) -> Engine:
        """The caller's engine `engine_id`, marked alive; UNKNOWN_ENGINE if absent or not the caller's."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.ident != ident:
            # Someone else's engine gets the same answer as none at all: ids reveal nothing.
            raise RequestError(E.UNKNOWN_ENGINE, f"engine {engine_id} is not registered on this connection "
                               f"(register first; engines silent for {self.client_timeout_s:g}s are reclaimed)")
        eng.last_seen = self.now()
        return eng

    def add_engine(self, ident: bytes, name: str, layout: ModelLayout, ns: bytes, chunk_tokens: int,
                   object_bytes: list[int]) -> Engine:
        if len(self.engines) >= self.limits.max_engines:
            raise RequestError(E.LIMIT, f"{len(self.engines)} engines registered, the server's limit "
                               f"(--max-engines {self.limits.max_engines})")
        mine = self._per_client.get(ident, 0)
        if mine >= self.limits.max_engines_per_client:
            raise RequestError(E.LIMIT, f"{mine} engines registered by this connection, the limit "
                               f"(--max-engines-per-client {self.limits.max_engines_per_client}); unregister one")
        eid = self._new_id()
        eng = Engine(eid, ident, name or f"engine-{eid:x}", layout, ns, chunk_tokens, object_bytes, self.now())
        self.engines[eid] = eng
        self._per_client[ident] = mine + 1
        return eng

    def add_reservation(self, eng: Engine, request: str, slots: list[Slot]) -> Reservation:
        if len(eng.reservations) >= self.limits.max_reservations:
            raise RequestError(E.LIMIT, f"engine {eng.id} holds {len(eng.reservations)} open reservations, "
                               f"the limit (--max-reservations {self.limits.max_reservations})")
        res = Reservation(self._new_id(), eng, request, slots, fence=self.fences.take())
        self.reservations[res.id] = eng.reservations[res.id] = res
        return res

    def add_lease(self, eng: Engine, request: str, entries: list[Entry], locs: list[P.ObjectLoc]) -> Lease:
        """Record a lease; the caller checked `lease_room` before pinning."""
        lease = Lease(self._new_id(), eng, request, entries, locs)
        self.leases[lease.id] = eng.leases[lease.id] = lease
        return lease

    def lease_room(self, eng: Engine) -> None:
        if len(eng.leases) >= self.limits.max_leases:
            raise RequestError(E.LIMIT, f"engine {eng.id} holds {len(eng.leases)} leases, the limit "
                               f"(--max-leases {self.limits.max_leases}); release or end sessions first")

    def reservation(self, eng: Engine, rid: int) -> Reservation:
        res = eng.reservations.get(rid)
        if res is None:
            raise RequestError(E.UNKNOWN_RESERVATION, f"reservation {rid} is not open for engine {eng.id} "
                               "(never made, already committed or aborted, or reclaimed)")
        if res.committing:
            raise RequestError(E.UNKNOWN_RESERVATION, f"reservation {rid} is already being committed")
        return res

    def lease(self, eng: Engine, lid: int) -> Lease:
        lease = eng.leases.get(lid)
        if lease is None:
            raise RequestError(E.UNKNOWN_LEASE, f"lease {lid} is not held by engine {eng.id} "
                               "(never made, already released, or reclaimed)")
        return lease

    def close_reservation(self, res: Reservation) -> None:
        if self.reservations.pop(res.id, None) is not None:
            self.released_objects += len(res.slots)
            self.fences.give_back(res.fence)
        res.engine.reservations.pop(res.id, None)

    def close_lease(self, lease: Lease) -> None:
        if self.leases.pop(lease.id, None) is not None:
            self.released_objects += len(lease.entries)
        lease.engine.leases.pop(lease.id, None)

    def remove_engine(self, eng: Engine) -> tuple[list[Lease], list[Reservation]]:
        """Forget an engine; returns its leases and reservations for the caller to release."""
        leases, reservations = list(eng.leases.values()), list(eng.reservations.values())
        for lease in leases:
            self.close_lease(lease)
        for res in reservations:
            self.close_reservation(res)
        if self.engines.pop(eng.id, None) is not None:
            left = self._per_client.pop(eng.ident) - 1
            if left:
                self._per_client[eng.ident] = left
        return leases, reservations

    def silent(self, now: float) -> list[Engine]:
        """The engines silent past the client timeout at `now` (`Sessions.now`)."""
        return [e for e in self.engines.values() if now - e.last_seen > self.client_timeout_s]
