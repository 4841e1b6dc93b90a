"""Work in turns: a large request does at most TURN_S of work in one loop turn, then lets every other client's
request through before its next turn (docs/protocol.md, Limits: how long one request holds the loop).

A Lookup or Prefetch is a generator: it yields TURN when its share of the turn is spent (the loop steps it
again after its next poll, which then does not wait) and WAIT when it waits for workers (L2 reads, spills);
`drive` runs it for one turn. A small one runs under an endless clock: the same op, that never yields TURN.
Its pieces are SLICE_OBJECTS objects between two clock reads. A PrepareStore works in turns the same way with its
own loop (store.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, TypeVar

import msgspec

from hybridkv.server.books.l1 import Entry
from hybridkv.server.books.objects import ObjectStore
from hybridkv.server.ops.context import Context
from hybridkv.wire import protocol as P

if TYPE_CHECKING:
    from hybridkv.server.books.records import Engine

log = logging.getLogger("hybridkv.server")

TURN_S = 0.005  # the time a large request works in one loop turn
SLICE_OBJECTS = 1024  # objects between two clock reads
# A Lookup or Prefetch of more objects than this (keys x groups) works in turns; below it, one turn does it all
# (a few ms at most) under an endless clock, which never reads the time twice for nothing (the latency case).
BIG_OBJECTS = 4096

TURN = "turn"
WAIT = "wait"
Work = Generator[str, None, None]
T = TypeVar("T")
Steps = Generator[str, None, T]

_encoder = msgspec.msgpack.Encoder()


class Clock:
    """When this turn's share ends (perf_counter). An `endless` clock never ends a turn: a small request runs the
    op a large one runs in turns, and does it all in one."""
    __slots__ = ("until", "endless")

    def __init__(self, endless: bool = False) -> None:
        self.endless = endless
        self.until = float("inf") if endless else 0.0

    def start(self) -> None:
        """A new turn: its share is TURN_S from now."""
        if not self.endless:
            self.until = time.perf_counter() + TURN_S

    def over(self) -> bool:
        return time.perf_counter() > self.until


def drive(ctx: Context, work: Work, clock: Clock) -> bool:
    """Run `work` for one turn of TURN_S (all of it under an endless clock, unless it waits); True once it has
    finished."""
    clock.start()
    try:
        why = next(work)
    except StopIteration:
        return True
    if why is TURN:
        ctx.another_turn = True
    return False


def probe_l2(objects: ObjectStore, keys: list[bytes], groups: int, clock: Clock) -> Work:
    """`ObjectStore.probe_l2` of these keys in pieces (a no-op for adapters whose index is local)."""
    if not objects.probes_l2:
        return
    step = max(1, 4 * SLICE_OBJECTS // groups)
    for i in range(0, len(keys), step):
        objects.probe_l2(keys[i:i + step], groups)
        if clock.over():
            yield TURN


def unpin(objects: ObjectStore, entries: Sequence[Entry], clock: Clock) -> Work:
    """Drop one pin of each of `entries`, in their order (an object left unpinned goes to its queue's young end)."""
    for i in range(0, len(entries), SLICE_OBJECTS):
        objects.unpin_all(entries[i:i + SLICE_OBJECTS])
        if clock.over() and i + SLICE_OBJECTS < len(entries):
            yield TURN


def unpin_off(objects: ObjectStore, entries: list[Entry], clock: Clock) -> Work:
    """Drop one pin of each of `entries`, taking each piece off the list's end as it is let go: the work closed
    between two turns (its engine gone) leaves in `entries` exactly the pins still held, for whoever lets go next."""
    while entries:
        piece = entries[-SLICE_OBJECTS:]
        del entries[-SLICE_OBJECTS:]
        objects.unpin_all(piece)
        if entries and clock.over():
            yield TURN


def empty(lists: Sequence[list], clock: Clock) -> Work:
    """Empty `lists` from their ends, in pieces: the objects they alone hold are freed a piece at a time (a closed
    lease's locations, or a reservation's slots, freed in one step are one long stop of the loop)."""
    for lst in lists:
        while lst:
            del lst[-SLICE_OBJECTS:]
            if lst and clock.over():
                yield TURN


class LetGo:
    """The pins of released leases let go in turns, after the Release, EndSession or Unregister that closed them
    answered (in one piece a 64-group x 16k-key lease's pins hold the loop far past a turn), then the lists
    of what is done with emptied in turns. Until its last piece an object stays pinned a few turns longer: only its
    eviction waits. It answers nothing."""

    answered = True
    ident = b""
    req_id = 0

    def __init__(self, ctx: Context, entries: Sequence[Entry], done_with: Sequence[list] = ()):
        self.ctx, self.clock = ctx, Clock()
        self._work = self._both(entries, done_with)

    def _both(self, entries: Sequence[Entry], done_with: Sequence[list]) -> Work:
        yield from unpin(self.ctx.objects, entries, self.clock)
        yield from empty(done_with, self.clock)

    def step(self) -> bool:
        try:
            return drive(self.ctx, self._work, self.clock)
        except Exception:  # nothing to answer: the loop must not send an error to nobody
            log.exception("internal error while letting go of released leases")
            return True


def let_go(ctx: Context, entries: Sequence[Entry], done_with: Sequence[list] = ()) -> None:
    """Unpin `entries` (leases closed in the books already), then empty the lists `done_with` (what a closed lease,
    reservation or request held, that nothing reads any more): in this turn when they are few, else in turns."""
    if len(entries) <= BIG_OBJECTS:
        ctx.objects.unpin_all(entries)
        done_with = [lst for lst in done_with if len(lst) > BIG_OBJECTS]
        if not done_with:
            return
        entries = ()
    op = LetGo(ctx, entries, done_with)
    if not op.step():
        ctx.park(op)


def free_later(ctx: Context, *done_with: list) -> None:
    """Empty these lists (of a request that answered, that nothing reads any more) in turns when they are long."""
    let_go(ctx, (), done_with)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def encoded_locs(locs: list[P.ObjectLoc], clock: Clock) -> Steps[msgspec.Raw]:
    """`locs` as the msgpack bytes the reply's encoder would write for the list, encoded in pieces (524,288
    locations are 5.8 MB, more than a turn's work in one piece). A Raw in a reply's field is written as it is."""
    parts = [_array_header(len(locs))]
    step = 16 * SLICE_OBJECTS
    for i in range(0, len(locs), step):
        piece = locs[i:i + step]
        parts.append(_encoder.encode(piece)[len(_array_header(len(piece))):])
        if clock.over():
            yield TURN
    return msgspec.Raw(b"".join(parts))


class TurnedOp:
    """What a request working in turns shares (LookupOp, PrefetchOp): `_run` until it
    answered, then `_let_go` of what it holds; an engine that vanished meanwhile is answered unknown_engine and
    its pins are let go in turns. Subclasses name their `kind` and say what an internal error must drop."""

    kind = "request"
    ctx: Context
    ident: bytes
    req_id: int
    eng: Engine
    answered: bool
    clock: Clock
    _work: Work

    def _let_go(self) -> Work:
        raise NotImplementedError

    def _drop_all(self) -> None:
        """After an internal error: unpin everything, undo what it counted."""
        raise NotImplementedError

    def step(self) -> bool:
        ctx = self.ctx
        if not self.answered and ctx.sessions.engines.get(self.eng.id) is not self.eng:
            self._work.close()
            self.answered = True
            ctx.fail(self.ident, self.req_id, P.ErrorCode.UNKNOWN_ENGINE, f"engine {self.eng.id} was unregistered "
                     f"or reclaimed while this {self.kind} worked")
            self._work = self._let_go()
        try:
            return drive(ctx, self._work, self.clock)
        except Exception:
            self._drop_all()  # an internal error: nothing may stay pinned
            if not self.answered:
                raise  # the loop answers it
            log.exception("internal error after a %s answered", self.kind)
            return True
