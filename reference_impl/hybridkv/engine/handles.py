"""What the transfer library hands back: a lookup's `Hit` and the asynchronous `TransferHandle`."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from hybridkv import protocol as P


@dataclass(slots=True)
class Hit:
    """A lookup's answer: the resumable prefix, and the server-side objects pinned for it."""

    request_id: str
    keys: list[bytes]
    hit_chunks: int
    chunk_tokens: int
    lease: int
    objects: list[P.ObjectLoc]

    @property
    def hit_tokens(self) -> int:
        return self.hit_chunks * self.chunk_tokens

    @property
    def nbytes(self) -> int:
        return sum(o.length for o in self.objects)


@dataclass(eq=False)
class TransferHandle:
    """An asynchronous store or retrieve. `done` resolves when the engine's pages are free to use
    (store: read; retrieve: written); for a store `committed` resolves once the server made it visible."""

    kind: Literal["store", "load"]
    request_id: str
    done: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    t_submit: float = field(default_factory=time.perf_counter)
    t_copy_start: float = 0.0
    t_done: float = 0.0
    t_committed: float = 0.0
    nbytes: int = 0
    objects: int = 0
    skipped: int = 0
    refused: int = 0

    def wait(self, timeout: float | None = None) -> TransferHandle:
        """Block until the pages are safe (store: read; retrieve: written); re-raises a failure."""
        self.done.result(timeout)
        return self

    def wait_committed(self, timeout: float | None = None) -> TransferHandle:
        """Block until the server made a store's objects visible (a retrieve: same as `wait`)."""
        self.committed.result(timeout)
        return self

    @property
    def copy_s(self) -> float:
        return self.t_done - self.t_copy_start

    @property
    def total_s(self) -> float:
        return (self.t_committed or self.t_done) - self.t_submit
