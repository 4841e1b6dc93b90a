"""The two routes a transfer's bytes take, one per kind of wire, chosen once when `KVTransfer` is built.

A `DirectRoute` drives a `DirectWire` (the server's arena slots): it queues the page copies to or from the slots,
waits for them, then commits a store or releases a load's lease. On CUDA the caller of store() / retrieve() queues
the (asynchronous) copies, so no hand-off precedes the first byte; the worker waits for them. Elsewhere copies run
synchronously, on the workers. A `PayloadRoute` hands a whole store or load to its `PayloadWire`, on a worker.

Both share what `Route` holds: the workers (stores and loads on their own threads: a store parked behind L2
never delays a retrieve), the requests finished since `get_finished`, the commits in flight, and what a
failure or a cancel() does (a cancelled load never writes, a cancelled store never commits).
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import CancelledError, Future
from typing import Literal

import torch

from hybridkv.engine.client import CacheClient
from hybridkv.engine.copies import Bound, Issued, LayerSteps, PageCopies, PlannedPages
from hybridkv.engine.handles import Hit, PreparedStore, TransferHandle, relay
from hybridkv.engine.wire import CopyFn, DirectWire, ObjectJob, PayloadWire
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import traits

Kind = Literal["store", "load"]
# A transfer's handle and the worker's step for it: the whole transfer, or the end of one whose copies its
# caller queued already (a direct wire on CUDA): wait for them, then commit / release.
_Item = tuple[TransferHandle, Callable[..., None], tuple]


class Route(ABC):
    """How one engine's stores and loads run, from the caller's thread to their handles' resolution."""

    def __init__(self, client: CacheClient, engine_id: int, copies: PageCopies, timeout_s: float):
        self.client = client
        self.engine_id = engine_id
        self.copies = copies
        self.timeout_s = timeout_s
        self._finished: dict[Kind, set[str]] = {"store": set(), "load": set()}
        self._finished_lock = threading.Lock()
        self._commits: set[Future] = set()  # stores' commits in flight (drain waits for them)
        self._store_q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, args=(self._store_q,), name="hkv-store", daemon=True),
                         threading.Thread(target=self._work, args=(self._load_q,), name="hkv-load", daemon=True)]
        for w in self._workers:
            w.start()

    @abstractmethod
    def store(self, h: TransferHandle, prepared: PreparedStore, jobs: list[ObjectJob], pages: PlannedPages | None,
              ready: torch.cuda.Event | None) -> None:
        """Start a store of `prepared`'s objects from `jobs`' blocks (copies after `ready`); `h` tells the rest."""

    @abstractmethod
    def load(self, h: TransferHandle, hit: Hit, jobs: list[ObjectJob], ready: torch.cuda.Event | None,
             steps: LayerSteps | None = None, inline: bool = False) -> None:
        """Start a load of `hit`'s objects into `jobs`' blocks (copies after `ready`; layer by layer in
        `steps`' order where the copies are queued by the caller); `h` tells the rest, and the lease is
        released once it is done or failed. `inline`: copies that would run on the load thread run on the
        caller's (a direct wire on a CPU: `KVTransfer.retrieve`)."""

    def prebind(self, prep: PreparedStore) -> None:  # noqa: B027 - a hook: only the direct route binds ahead
        """Bind `prep`'s planned pages to its slots when the answer comes, where that saves work (`prep.bound`)."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose stores / retrieves completed since the last call."""
        with self._finished_lock:
            out = (self._finished["store"], self._finished["load"])
            self._finished = {"store": set(), "load": set()}
        return out

    def drain(self) -> None:
        """Finish the queued transfers and wait for the commits in flight (they resolve on the client's thread)."""
        self._store_q.put(None)
        self._load_q.put(None)
        for w in self._workers:
            w.join(timeout=self.timeout_s)
        with self._finished_lock:
            commits = list(self._commits)
        futures.wait(commits, timeout=self.timeout_s + 5)

    def abort_prepared(self, reply: Future) -> None:
        """A prepared store that will never run: free its slots once the server's answer is in."""
        if reply.exception() is None:
            self._abort(reply.result()[0].reservation, wait=False)

    # ---- shared steps -------------------------------------------------------------------------------

    def _work(self, q: queue.SimpleQueue[_Item | None]) -> None:
        """Run each queued step; a failure is delivered through its handle and the worker keeps going."""
        while (item := q.get()) is not None:
            self._run(item)

    def _run(self, item: _Item) -> None:
        h, fn, args = item
        try:
            fn(h, *args)
        except BaseException as e:
            self._fail(h, e)

    @staticmethod
    def _fail(h: TransferHandle, e: BaseException) -> None:
        for f in (h.done, h.committed):
            try:
                f.set_exception(e)
            except futures.InvalidStateError:
                pass  # resolved already (a fenced store's commit answer may resolve it on another thread)

    def _resolve_done(self, h: TransferHandle) -> None:
        """The engine's pages are free: report the request to get_finished, then wake waiters. Once: a fenced
        store learns it from its copies' events or from the commit's answer, whichever comes first."""
        with self._finished_lock:
            if h.done.done():  # done already, or failed (a fenced commit's error came first)
                return
            self._finished[h.kind].add(h.request_id)
            if not h.t_done:
                h.t_done = time.perf_counter()
        try:
            h.done.set_result(h)
        except futures.InvalidStateError:
            pass  # the other thread resolved or failed it meanwhile: the first one stands

    def _scatter(self, h: TransferHandle, ready: torch.cuda.Event | None) -> CopyFn:
        """A load's copy step: the last moment a cancel can stop it (nothing written yet), then the copies."""
        scatter = self.copies.copier(h, "scatter", ready)

        def copy(items: list) -> None:
            h.proceed()
            scatter(items)

        return copy

    def _nothing_to_store(self, h: TransferHandle, reply: P.Prepared) -> bool:
        """True (and the handle resolved) when the server held or refused every object: no slot to fill."""
        h.skipped, h.refused = len(reply.present), len(reply.refused)
        if reply.slots:
            return False
        h.t_copy_start = h.t_done = h.t_committed = time.perf_counter()
        self._resolve_done(h)
        h.committed.set_result(h)
        return True

    @staticmethod
    def _slot_jobs(reply: P.Prepared, jobs: list[ObjectJob]) -> list[ObjectJob]:
        """The reserved slots, each with the engine blocks of its object."""
        by_object = {(o.chunk, o.group): ids for o, ids in jobs}
        return [(s, by_object[s.chunk, s.group]) for s in reply.slots]

    def _pages_read(self, h: TransferHandle, reply: P.Prepared) -> None:
        """The store's pages are read; it commits unless cancel() came first (then the caller may have
        reused the blocks while they were read: CancelledError, and the reservation is aborted)."""
        h.proceed()
        self._count_slots(h, reply)
        self._resolve_done(h)

    @staticmethod
    def _count_slots(h: TransferHandle, reply: P.Prepared) -> None:
        """A store's bytes and objects: what its reservation's slots hold."""
        h.nbytes, h.objects = sum(s.length for s in reply.slots), len(reply.slots)

    def _track_commit(self, h: TransferHandle, reservation: int, commit: Future) -> None:
        """`committed` follows the commit's reply, on whichever thread receives it (the I/O thread for a
        payload-carrying commit: this worker goes on with the next store meanwhile)."""
        with self._finished_lock:
            self._commits.add(commit)
        commit.add_done_callback(lambda f: self._committed(h, reservation, f))

    def _committed(self, h: TransferHandle, reservation: int, commit: Future) -> None:
        with self._finished_lock:
            self._commits.discard(commit)
        exc = commit.exception()
        if exc is None:
            # a fenced commit's answer may come before the worker saw the copies' events: the fence showed,
            # so every page was read
            self._resolve_done(h)
            h.t_committed = time.perf_counter()
            h.committed.set_result(h)
            return
        self._abort(reservation, wait=False)  # on the I/O thread: never wait for a reply here
        self._fail(h, exc)

    def _abort(self, reservation: int, wait: bool = True) -> None:
        """Nothing half-written may stay reserved on the server."""
        if not reservation:
            return
        try:
            fut = self.client.submit(P.AbortStore(engine=self.engine_id, reservation=reservation))
            if wait:
                fut.result(timeout=5)
        except Exception:
            pass  # end_session or the server's reclaim of a silent engine frees it anyway

    def _do_load(self, h: TransferHandle, hit: Hit, move: Callable[[], None]) -> None:
        """Run `move` (the wire's fetch and copies, or the wait for copies the caller queued), then resolve
        and release the lease."""
        try:
            if not h.t_copy_start:
                h.t_copy_start = time.perf_counter()  # for a payload wire: fetch, decode and copy
            move()
            h.t_done = h.t_committed = time.perf_counter()
            h.objects = len(hit.objects)  # h.nbytes: the bytes written, set by KVTransfer.retrieve
        except BaseException:
            self._release(hit.lease)
            raise
        # The pages are written and every copy has finished reading the slots. The release goes on the socket
        # before the handle resolves and is not awaited: the engine need not wait for its round trip, and an
        # end_session the engine sends once it sees the load done comes after it (the other order would make
        # the server answer the release with an unknown lease).
        self._release(hit.lease, wait=False)
        self._resolve_done(h)
        h.committed.set_result(h)

    def release_soon(self, lease: int) -> None:
        """Unpin a lease without waiting for the answer (a hit that will not be retrieved)."""
        self._release(lease, wait=False)

    def _release(self, lease: int, wait: bool = True) -> None:
        if not lease:
            return  # a part of a hit whose lease another retrieve releases
        try:
            msg = P.Release(engine=self.engine_id, lease=lease)
            # without waiting: nobody reads the answer, so none is hurried (a load's caller wakes right after)
            self.client.call(msg) if wait else self.client.submit(msg, reply_soon=False)
        except Exception:
            pass  # end_session or the server's reclaim drops the pins anyway


class DirectRoute(Route):
    """Copies to or from the arena's slots, then a payload-free commit (a store) or the release (a load)."""

    def __init__(self, wire: DirectWire, client: CacheClient, engine_id: int, copies: PageCopies, timeout_s: float,
                 fenced: bool = False):
        super().__init__(client, engine_id, copies, timeout_s)
        self.wire = wire
        self._in_caller = copies.device.type == "cuda"  # copies only queue there: the caller queues them
        # commits sent with the copies (hybridkv.server.books.fences): a wire with fence words, the config asking for
        # it, and on CUDA DMA copies (the copy engine writes the fence after the pages, in stream order). On a
        # CPU the copies are synchronous: the fence is written and the commit sent once they are done (the
        # same protocol, nothing to overlap)
        self.fenced = fenced and wire.fences and (not self._in_caller or copies.impl == "dma")
        # A bind is a few hundred microseconds of Python under the GIL: one that ran on the I/O thread while the
        # caller queued a load's copies (an engine prepares a request's store right before loading its hit)
        # delayed that load by as much. Answers that come while a load is being queued leave their bind here,
        # and it runs once the load's copies are queued (on the load worker, while the copies run) or when a
        # store or drain needs it, whichever comes first.
        self._issuing = 0  # loads whose copies a caller is queueing now
        self._deferred: list[Callable[[], None]] = []
        self._defer_lock = threading.Lock()

    def prebind(self, prep: PreparedStore) -> None:
        """Bind a CUDA store's plans (and DMA runs) when the prepare is answered: on the thread that receives the
        answer, or, if a load's copies are being queued then, once they are (`_bind_deferred`). `prep.reply`
        resolves once bound, so a store never binds beside a binding. On failure `bound` stays None (store binds)."""
        if not self._in_caller or prep.pages is None or prep.jobs is None:
            return
        pages, jobs = prep.pages, prep.jobs
        answered: Future = Future()

        def bind(reply: Future) -> None:
            try:
                if not reply.cancelled() and reply.exception() is None and (answer := reply.result()[0]).slots:
                    prep.bound = self.copies.bind("gather", self.wire.slots(self._slot_jobs(answer, jobs)), pages)
            except Exception:  # noqa: BLE001 - the store binds again and fails there, with its handle
                pass
            relay(reply, answered)

        def answer(reply: Future) -> None:
            with self._defer_lock:
                if self._issuing:
                    self._deferred.append(lambda: bind(reply))
                    return
            bind(reply)

        prep.reply.add_done_callback(answer)
        prep.reply = answered

    def _bind_deferred(self, even_while_issuing: bool = False) -> None:
        """Run the binds deferred while loads were queued (each once, on this thread); unless
        `even_while_issuing`, only when no load is being queued now (they would delay it)."""
        with self._defer_lock:
            if not self._deferred or (self._issuing and not even_while_issuing):
                return
            binds, self._deferred = self._deferred, []
        for bind in binds:
            bind()

    def drain(self) -> None:
        self._bind_deferred(even_while_issuing=True)  # their answers resolve the prepared stores' replies
        super().drain()

    def store(self, h, prepared, jobs, pages, ready) -> None:
        self._bind_deferred(even_while_issuing=True)  # this store's own bind may be among them
        reply = prepared.reply
        if self._in_caller and reply.done() and reply.exception() is None:
            answer = reply.result()[0]
            bound = prepared.bound if pages is not None and pages is prepared.pages else None
            if (issued := self._issue_store(h, answer, jobs, pages, ready, bound)) is not None:
                h.queued = [ev for ev, _ in issued if ev is not None]
                self._store_q.put(self._after_issue(h, answer, issued))
        else:
            self._store_q.put((h, self._do_store, (prepared, jobs, pages, ready)))

    def _after_issue(self, h: TransferHandle, reply: P.Prepared, issued: Issued) -> _Item:
        """The worker's step once a store's copies are queued: with a fence, the fence is queued and the
        commit sent now (the worker only waits for the copies); without, wait for them, then commit."""
        if self.fenced and reply.fence:
            try:
                h.proceed()  # the commit leaves now: from here cancel() says the store goes on
            except CancelledError:
                return h, self._finish_store, (reply, issued)  # never commits: _pages_read raises, aborted
            try:
                issued = self.copies.fence(issued, self.wire.fence_word(reply.fence), reply.reservation)
                self._count_slots(h, reply)
                commit = self.wire.commit_fenced(h, reply.reservation)
            except BaseException as e:
                return h, self._abort_after_copies, (reply, issued, e)
            self._track_commit(h, reply.reservation, commit)
            return h, self._finish_fenced, (reply, issued)
        return h, self._finish_store, (reply, issued)

    def load(self, h, hit, jobs, ready, steps=None, inline=False) -> None:
        if not self._in_caller:
            copy = self._scatter(h, ready)
            item: _Item = (h, self._do_load, (hit, lambda: copy(self.wire.slots(jobs))))
            if inline:
                self._run(item)
            else:
                self._load_q.put(item)
            return
        with self._defer_lock:
            self._issuing += 1
        issued: Issued | None
        try:
            h.proceed()
            issued = self.copies.issue(h, "scatter", self.wire.slots(jobs), ready, steps=steps)
        except BaseException as e:
            self._fail(h, e)
            self._release(hit.lease, wait=False)
            issued = None
        with self._defer_lock:
            self._issuing -= 1
        if issued is None:
            self._bind_deferred()  # no load worker step follows to run them
            return
        self._load_q.put((h, self._do_load, (hit, lambda: self._wait_load(h, issued))))

    def _wait_load(self, h: TransferHandle, issued: Issued) -> None:
        """The load worker's wait for a load's copies: first the binds deferred while they were queued (the copies
        run meanwhile, and the thread that queued them is no longer held up by them)."""
        self._bind_deferred()
        self.copies.wait(h, issued)

    def _do_store(self, h: TransferHandle, prep: PreparedStore, jobs: list[ObjectJob], pages: PlannedPages | None,
                  ready: torch.cuda.Event | None) -> None:
        reply = prep.wait(self.timeout_s + 5)
        bound = prep.bound if pages is not None and pages is prep.pages else None  # bound already, if in time
        if (issued := self._issue_store(h, reply, jobs, pages, ready, bound)) is not None:
            _, step, args = self._after_issue(h, reply, issued)
            step(h, *args)

    def _issue_store(self, h: TransferHandle, reply: P.Prepared, jobs: list[ObjectJob], pages: PlannedPages | None,
                     ready: torch.cuda.Event | None, bound: Bound | None = None) -> Issued | None:
        """Queue the store's copies (on the caller's thread, or the worker's), from the plans `bound` ahead
        when given. None when the handle is settled already: the server held or refused every object, or
        queueing failed (the reservation is aborted, the error is in the handle)."""
        if self._nothing_to_store(h, reply):
            return None
        try:
            if bound is not None:
                return self.copies.issue(h, "gather", [], ready, bound=bound)
            return self.copies.issue(h, "gather", self.wire.slots(self._slot_jobs(reply, jobs)), ready, pages)
        except BaseException as e:
            self._abort(reply.reservation, wait=False)
            self._fail(h, e)
            return None

    def _finish_store(self, h: TransferHandle, reply: P.Prepared, issued: Issued) -> None:
        """The store after its copies were queued: wait for them, then commit."""
        try:
            self.copies.wait(h, issued)
            self._pages_read(h, reply)
            commit = self.wire.commit(h, reply.reservation)
        except BaseException:
            self._abort(reply.reservation)
            raise
        self._track_commit(h, reply.reservation, commit)

    def _finish_fenced(self, h: TransferHandle, reply: P.Prepared, issued: Issued) -> None:
        """A fenced store, its commit sent: wait for the copies; the commit's answer resolves `committed`."""
        try:
            self.copies.wait(h, issued)
        except BaseException:
            self._abort(reply.reservation)  # the server ends the waiting commit: nothing becomes visible
            raise
        self._resolve_done(h)

    def _abort_after_copies(self, h: TransferHandle, reply: P.Prepared, issued: Issued, e: BaseException) -> None:
        """The fence or the commit could not be sent: the reservation is aborted once the queued copies no
        longer write into its slots, and the store fails with that error."""
        try:
            self.copies.wait(h, issued)
        finally:
            self._abort(reply.reservation)
        raise e


class PayloadRoute(Route):
    """The wire moves the objects as frames: a whole store or load runs on a worker."""

    def __init__(self, wire: PayloadWire, client: CacheClient, engine_id: int, copies: PageCopies,
                 timeout_s: float):
        super().__init__(client, engine_id, copies, timeout_s)
        self.wire = wire

    def store(self, h, prepared, jobs, pages, ready) -> None:
        self._store_q.put((h, self._do_store, (prepared, jobs, pages, ready)))

    def load(self, h, hit, jobs, ready, steps=None, inline=False) -> None:
        copy = self._scatter(h, ready)  # a whole load on a worker: readers wait for `done`
        self._load_q.put((h, self._do_load, (hit, lambda: self.wire.load(h, hit, jobs, copy))))

    def _do_store(self, h: TransferHandle, prep: PreparedStore, jobs: list[ObjectJob], pages: PlannedPages | None,
                  ready: torch.cuda.Event | None) -> None:
        reply = prep.wait(self.timeout_s + 5)
        if self._nothing_to_store(h, reply):
            return
        try:
            copy = self.copies.copier(h, "gather", ready, pages)
            commit = self.wire.store(h, reply.reservation, self._slot_jobs(reply, jobs), copy, ready,
                                     lambda: self._pages_read(h, reply))
        except BaseException:
            self._abort(reply.reservation)
            raise
        self._track_commit(h, reply.reservation, commit)


def open_route(wire: DirectWire | PayloadWire, client: CacheClient, engine_id: int, copies: PageCopies,
               timeout_s: float, fenced: bool = False) -> Route:
    """The route the format's row of `hybridkv.wire.wire_formats.TRAITS` names (direct or not; `engine.wire` checks
    that each format's wire is of that kind). `fenced`: a direct route's stores send their commit with the
    copies where it can (`DirectRoute.fenced`)."""
    if traits(wire.format).direct:
        assert isinstance(wire, DirectWire)
        return DirectRoute(wire, client, engine_id, copies, timeout_s, fenced)
    assert isinstance(wire, PayloadWire)
    return PayloadRoute(wire, client, engine_id, copies, timeout_s)
