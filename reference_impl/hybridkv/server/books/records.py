"""The records the session tables hold: a registered engine, its store reservations (with their slots) and
its read leases. Kept apart from the tables so the fence books can name a reservation without importing the
session tables that own the fences."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.model.layout import ModelLayout
from hybridkv.server.books.l1 import Entry
from hybridkv.wire import protocol as P


@dataclass(slots=True, eq=False)
class Slot:
    chunk: int
    group: int
    entry: Entry


@dataclass(slots=True, eq=False)
class Reservation:
    id: int
    engine: Engine
    request: str
    slots: list[Slot]
    committing: bool = False
    dead: bool = False  # its engine was dropped while a commit copy was in flight
    fence: int = 0  # its fence word's arena offset (0: none), given back when it closes


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    engine: Engine
    request: str
    entries: list[Entry]
    locs: list[P.ObjectLoc]


@dataclass(slots=True, eq=False)
class Engine:
    id: int
    ident: bytes  # the routing id of the connection that registered it
    name: str
    layout: ModelLayout
    ns: bytes
    chunk_tokens: int
    object_bytes: list[int]
    last_seen: float  # on the sessions' clock (`Sessions.now`)
    reservations: dict[int, Reservation] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    prefetches: int = 0  # its Prefetch requests still waiting for room (bounded by max_prefetches)
