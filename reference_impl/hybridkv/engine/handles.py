"""What the transfer library hands back: a lookup's `Hit`, a store's early reservation (`PreparedStore`)
and the asynchronous `TransferHandle`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridkv.wire import protocol as P


def relay(src: Future, dst: Future) -> None:
    """Give `dst` the outcome of `src` (done): its result, its exception, or its cancellation; nothing when
    `dst` was settled meanwhile (cancelled by its holder)."""
    try:
        if src.cancelled():
            dst.cancel()
        elif (e := src.exception()) is not None:
            dst.set_exception(e)
        else:
            dst.set_result(src.result())
    except InvalidStateError:
        pass


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
class PreparedStore:
    """A store's reservation, asked for before its pages exist (when the engine schedules the request).

    `reply` resolves to the server's `Prepared` answer on the client's I/O thread: no engine thread waits
    for it. One `store(..., prepared=...)` uses it; `end_session` (or the server's reclaim of a silent
    engine) aborts a reservation whose store never comes.
    """

    request_id: str
    keys: list[bytes]
    start_chunk: int
    objects: list[tuple[int, int]]  # (chunk, group) asked for, in the order the server answers
    reply: Future  # -> (P.Prepared, frames)
    t_submit: float = field(default_factory=time.perf_counter)
    used: bool = False
    # Given block ids: every object's blocks, validated, and the engine half of the copy plan per stream,
    # made while the prepare was in flight; a store from the same blocks binds the slots to them.
    block_ids: Any = None
    jobs: list | None = None
    pages: dict[int, tuple[Any, list[tuple[int, int]]]] | None = None
    # The plans bound to the reserved slots once the answer came (on the client's I/O thread, where the route
    # binds ahead: `Route.prebind`): the store then only queues the copies. None until then.
    bound: Any = None

    def wait(self, timeout: float | None = None) -> P.Prepared:
        """The server's answer (slots reserved, objects present, objects refused); re-raises a failure."""
        return self.reply.result(timeout)[0]


@dataclass(eq=False)
class TransferHandle:
    """An asynchronous store or retrieve. `done` resolves when the engine's pages are free to use
    (store: read; retrieve: written); for a store `committed` resolves once the server made it visible."""

    kind: Literal["store", "load"]
    request_id: str
    done: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    t_submit: float = field(default_factory=time.perf_counter)
    t_prepare: float = 0.0  # a store: when its prepare was submitted (== t_submit unless prepared ahead)
    t_copy_start: float = 0.0
    t_copy_issued: float = 0.0  # every copy queued (plan bound, DMA or kernel launched); t_done: they finished
    t_done: float = 0.0
    t_commit_sent: float = 0.0  # a store: its commit sent (t_committed - t_commit_sent: the commit round trip)
    t_committed: float = 0.0
    nbytes: int = 0
    objects: int = 0
    skipped: int = 0
    refused: int = 0
    # A store on CUDA whose copies the caller's thread queued: the events recorded after them, one per copy
    # stream. An engine that makes its own stream wait on these (`order_after_copies`) may reuse the blocks
    # at once without waiting for `done`: whatever it queues next on that stream runs after the pages are read.
    queued: list[Any] | None = None
    # A layer-wise load on CUDA (`retrieve(layerwise=True)`): per layer name, the events recorded after that
    # layer's copies; `wait_layer` orders a reader after them alone.
    layer_ready: dict[str, list[Any]] | None = None
    # cancel() against the point of no return (a load's first write into the engine's pages, a store's
    # commit after its pages were read): whichever comes first wins, under the lock
    _gate: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _cancelled: bool = False
    _passed: bool = False

    def order_after_copies(self, stream: Any) -> bool:
        """Make CUDA `stream` wait for this store's copies (on the GPU, not in this thread). True when that
        orders everything later on `stream` after the pages are read; False when the copies are not queued
        yet (the reservation's answer was not in when the store was asked for): the caller waits for `done`."""
        if not self.queued:
            return False
        for ev in self.queued:
            stream.wait_event(ev)
        return True

    def wait_layer(self, name: str, stream: Any = None, timeout: float | None = None) -> None:
        """Order what comes next on CUDA `stream` (default: the current one) after layer `name`'s pages are
        written, on the GPU: the calling thread does not wait. Without layer events (a CPU, a payload wire,
        a load that is not layer-wise) it waits for the whole load in this thread, re-raising its failure."""
        events = self.layer_ready.get(name) if self.layer_ready is not None else None
        if events is None:
            self.done.result(timeout)
            return
        if self.done.done() and self.done.exception() is not None:
            raise self.done.exception()  # type: ignore[misc]
        if stream is None:
            import torch

            stream = torch.cuda.current_stream()
        for ev in events:
            stream.wait_event(ev)

    def cancel(self) -> bool:
        """Give the transfer up: True when it will never write the engine's pages (a load) or commit (a
        store), False when it passed that point already (its copies then end on their own, in bounded
        time, reading or writing memory the caller still held when it asked)."""
        with self._gate:
            if not self._passed:
                self._cancelled = True
            return self._cancelled

    def proceed(self) -> None:
        """Pass the point of no return, or raise CancelledError when cancel() came first."""
        with self._gate:
            if self._cancelled:
                raise CancelledError(f"the {self.kind} of {self.request_id!r} was cancelled")
            self._passed = True

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

    @property
    def span_s(self) -> float:
        """A store: prepare submitted -> committed, the round trips an early prepare hid included."""
        return (self.t_committed or self.t_done) - (self.t_prepare or self.t_submit)
