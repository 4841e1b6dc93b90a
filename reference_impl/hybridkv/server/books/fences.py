"""Fenced commits: a store's commit sent with its copies, published once the engine's fence word shows.

A store on the shm wire used to be: queue the page copies, wait for them, then send CommitStore and wait for
its answer. That commit is a round trip made after the copies, while both processes (and ZMQ's I/O threads)
sleep, several times as long as a round trip made back to back, and the fixed cost that caps short stores. A
fenced commit takes it off the path:

1. Every reservation gets a fence word: 8 bytes in the arena file, above the slots (`Arena.fence_base`),
   zeroed when handed out. `Prepared.fence` is its offset (0: none, the classic commit applies).
2. The engine queues its page copies, then on the same stream (after every copy stream) a copy of the
   reservation id into the fence word, and sends `CommitStore(fenced=True)` at once: the commit travels while
   the copies run.
3. The server keeps such a commit pending and, between requests, compares each pending fence word with its
   reservation id; when they match, every copy before it has landed (one stream: the copy engine writes in
   order, PCIe keeps posted writes in order), and the objects are published and the commit answered.

Nothing is published early: a word is published on only its own reservation id (random 63 bits, never reused),
so a late write of a reservation that ended before (aborted, reclaimed) cannot match the word's next owner,
and words are reused oldest-freed first. A fence that never shows ends in the commit's failure after
`client_timeout_s` (the slots quarantined: the engine's copies may still land); an AbortStore (the engine's
copies failed), the engine's unregister or its reclaim end it at once the same way.

While a fence is pending the loop does not sleep in its poll: it spins for fences younger than SPIN_S (the
short stores this is for), and past that naps NAP_S between looks (a long store's copies take tens of ms;
the nap hands the GIL and the core to others, and costs its length at most in latency).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.memory.arena import SLOT_ALIGN, Arena

if TYPE_CHECKING:
    from hybridkv.server.books.records import Reservation

FENCE_WORD = 8
FENCE_WORDS = 16384  # 128 KiB: more reservations open at once than that commit the classic way
SPIN_S = 0.01
NAP_S = 0.0001


def fence_region_bytes(l1_bytes: int) -> int:
    """The fence region for an L1 of `l1_bytes`: FENCE_WORDS words, fewer for a tiny L1 (1/64 of it)."""
    words = min(FENCE_WORDS, max(SLOT_ALIGN // FENCE_WORD, l1_bytes // 64 // FENCE_WORD))
    return -(-words * FENCE_WORD // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(slots=True, eq=False)
class Pending:
    """A fenced commit waiting for its word."""

    res: Reservation
    ident: bytes
    req_id: int
    word: int
    deadline: float


class Fences:
    """The arena's fence words: handed out per reservation, and the fenced commits waiting on them."""

    def __init__(self, arena: Arena):
        n = (arena.file_bytes - arena.fence_base) // FENCE_WORD
        self.base = arena.fence_base
        self.words = np.frombuffer(arena.buf, dtype=np.int64, count=n, offset=arena.fence_base) if n else \
            np.zeros(0, np.int64)
        self._free: deque[int] = deque(range(n))
        self.pending: dict[int, Pending] = {}  # reservation id -> its commit
        self._ids = np.zeros(0, np.int64)
        self._idx = np.zeros(0, np.int64)
        self._order: list[Pending] = []
        self._next_deadline = float("inf")
        self._stale = True
        self._youngest = 0.0

    def take(self) -> int:
        """A zeroed fence word's arena offset, or 0 when every word is in use (the classic commit then)."""
        if not self._free:
            return 0
        w = self._free.popleft()
        self.words[w] = 0
        return self.base + w * FENCE_WORD

    def give_back(self, offset: int) -> None:
        if offset:
            self._free.append((offset - self.base) // FENCE_WORD)

    def word(self, offset: int) -> int:
        """The index of the word at arena `offset`; ValueError when it is not one of ours."""
        w, r = divmod(offset - self.base, FENCE_WORD)
        if r or not 0 <= w < len(self.words):
            raise ValueError(f"arena offset {offset} is not a fence word")
        return w

    def shown(self, offset: int, rid: int) -> bool:
        return bool(self.words[self.word(offset)] == rid)

    def wait(self, res: Reservation, ident: bytes, req_id: int, offset: int, timeout_s: float) -> None:
        now = time.monotonic()
        self.pending[res.id] = Pending(res, ident, req_id, self.word(offset), now + timeout_s)
        self._youngest = now
        self._stale = True

    def drop(self, rid: int) -> Pending | None:
        p = self.pending.pop(rid, None)
        if p is not None:
            self._stale = True
        return p

    def nap_s(self) -> float:
        """How long the loop sleeps after a poll that found nothing, while fences are pending: 0 (spin) for a
        fence younger than SPIN_S, else NAP_S."""
        return 0.0 if time.monotonic() - self._youngest < SPIN_S else NAP_S

    def ready(self) -> tuple[list[Pending], list[Pending]]:
        """(fences that showed, commits past their deadline): both removed from `pending`."""
        if self._stale:
            self._order = list(self.pending.values())
            self._ids = np.fromiter((p.res.id for p in self._order), np.int64, len(self._order))
            self._idx = np.fromiter((p.word for p in self._order), np.int64, len(self._order))
            self._next_deadline = min((p.deadline for p in self._order), default=float("inf"))
            self._stale = False
        if not self._order:
            return [], []
        hit = np.flatnonzero(self.words[self._idx] == self._ids)
        shown = [self._order[i] for i in hit]
        late: list[Pending] = []
        now = time.monotonic()
        if now >= self._next_deadline:
            showed = set(hit.tolist())
            late = [p for i, p in enumerate(self._order) if i not in showed and p.deadline <= now]
        for p in shown + late:
            del self.pending[p.res.id]
        if shown or late:
            self._stale = True
        return shown, late
