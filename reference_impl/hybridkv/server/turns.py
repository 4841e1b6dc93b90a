"""Work in turns: a large request does at most TURN_S of work in one loop turn, then lets every other client's
request through before its next turn (docs/protocol.md, Limits: how long one request holds the loop).

A large Lookup or Prefetch is a generator: it yields TURN when its share of the turn is spent (the loop steps it
again after its next poll, which then does not wait) and WAIT when it waits for workers (L2 reads, spills);
`drive` runs it for one turn. Its pieces are SLICE_OBJECTS objects between two clock reads. A PrepareStore works
in turns the same way with its own loop (store.py).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TypeVar

import msgspec

from hybridkv import protocol as P
from hybridkv.server.context import Context
from hybridkv.server.l1 import Entry
from hybridkv.server.objects import ObjectStore

TURN_S = 0.005  # the time a large request works in one loop turn
SLICE_OBJECTS = 1024  # objects between two clock reads
# A Lookup or Prefetch of more objects than this (keys x groups) works in turns; below it, one turn does it all
# (a few ms at most) on the one-turn path, which costs nothing more than before (the latency case: 71 keys).
BIG_OBJECTS = 4096

TURN = "turn"
WAIT = "wait"
Work = Generator[str, None, None]
T = TypeVar("T")
Steps = Generator[str, None, T]

_encoder = msgspec.msgpack.Encoder()


class Clock:
    """When this turn's share ends (perf_counter)."""
    __slots__ = ("until",)

    def __init__(self) -> None:
        self.until = 0.0

    def over(self) -> bool:
        return time.perf_counter() > self.until


def drive(ctx: Context, work: Work, clock: Clock) -> bool:
    """Run `work` for one turn of TURN_S; True once it has finished."""
    clock.until = time.perf_counter() + TURN_S
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


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def encoded_locs(locs: list[P.ObjectLoc], clock: Clock) -> Steps[msgspec.Raw]:
    """`locs` as the msgpack bytes the reply's encoder would write for the list, encoded in pieces (524,288
    locations are 5.8 MB: 25 ms in one piece on the 2-core VM). A Raw in a reply's field is written as it is."""
    parts = [_array_header(len(locs))]
    step = 16 * SLICE_OBJECTS
    for i in range(0, len(locs), step):
        piece = locs[i:i + step]
        parts.append(_encoder.encode(piece)[len(_array_header(len(piece))):])
        if clock.over():
            yield TURN
    return msgspec.Raw(b"".join(parts))
