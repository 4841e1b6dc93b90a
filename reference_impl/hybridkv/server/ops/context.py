"""What every request handler is given: the configuration, the session and object tables, the
workers, the counters, and how to answer. Handlers are plain functions over a Context."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridkv.memory.arena import Arena
from hybridkv.model.keys import KEY_BYTES
from hybridkv.server.books.clear_lane import ClearLane
from hybridkv.server.books.config import ServerConfig
from hybridkv.server.books.counters import Counters
from hybridkv.server.books.errors import RequestError
from hybridkv.server.books.formats import Formats
from hybridkv.server.books.objects import ObjectStore
from hybridkv.server.books.sessions import Sessions
from hybridkv.server.books.telemetry import Telemetry
from hybridkv.server.machinery.workers import Workers
from hybridkv.wire import protocol as P

E = P.ErrorCode
Frames = Sequence[Any]
Answer = tuple[P.Message, Frames] | None  # None: the handler answers later itself


class Parked(Protocol):
    """A request that waits for workers (spills, prefetches); step() is retried until it answers."""
    ident: bytes
    req_id: int

    def step(self) -> bool:
        """Make progress; True once it has answered."""


@dataclass(slots=True, eq=False)
class Context:
    config: ServerConfig
    arena: Arena
    sessions: Sessions
    objects: ObjectStore
    workers: Workers
    counters: Counters
    formats: Formats
    started: float
    send: Callable[[bytes, int, P.Message, Frames], None]
    """Answer a request later (a deferred answer: the client's pending count goes down)."""
    parked: list[Parked] = field(default_factory=list)
    """Requests waiting for workers; the loop steps them again when a worker finishes."""
    telemetry: Telemetry = field(default_factory=Telemetry)
    """Latencies, error codes and the snapshots other threads read (metrics endpoint, Status)."""

    clear_lane: ClearLane = field(default_factory=ClearLane)
    """The L2 parts of Clears, one walk at a time (clear.py)."""

    another_turn: bool = False
    """A parked request stopped at its share of one loop turn (not to wait for a worker): the loop steps the
    parked requests again after its next poll, which then does not wait."""

    def park(self, op: Parked) -> None:
        self.parked.append(op)

    def fail(self, ident: bytes, req_id: int, code: E, message: str) -> None:
        """A deferred error answer."""
        self.counters.errors += 1
        self.send(ident, req_id, P.Error(code=code, message=message), ())


def no_frames(msg: P.Message, frames: Frames) -> None:
    if frames:
        raise RequestError(E.BAD_PAYLOAD, f"{type(msg).__name__} carries no payload frames, got {len(frames)}")


def check_keys(keys: list[bytes], limit: int) -> list[bytes]:
    """Keys of one request: at most `limit`, each 16 bytes, none repeated (a repeat would be pinned
    once but released per entry, so pin counts would drift; chunk keys of one prefix never repeat)."""
    if len(keys) > limit:
        raise RequestError(E.LIMIT, f"{len(keys)} keys in one request; the limit is {limit} (--max-keys)")
    if any(n != KEY_BYTES for n in set(map(len, keys))):  # the lengths in C; the loop only names the bad key
        i, k = next((i, k) for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise RequestError(E.BAD_REQUEST, f"key {i} is {len(k)} bytes; chunk keys are {KEY_BYTES} bytes")
    if len(set(keys)) != len(keys):
        seen: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            if k in seen:
                raise RequestError(E.BAD_REQUEST, f"key {i} repeats key {seen[k]} ({k.hex()}): every key of a "
                                   "request must be distinct")
            seen[k] = i
    return keys
