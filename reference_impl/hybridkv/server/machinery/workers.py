"""Worker threads for disk and payload work; completions run later on the loop thread.

A job runs on a worker; its `done(result, exc)` callback is queued and run by the loop thread when it
drains completions, so every table is only ever touched by the loop thread. After close() no job is
accepted (a spill or prefetch asked for during shutdown is skipped, never an exception).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("hybridkv.server")

Done = Callable[[Any, BaseException | None], None]


class Workers:
    """A thread pool whose completions are handed back to one loop thread through a wake-up pipe."""

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hkv-io")
        self._done: queue.SimpleQueue[tuple[Done, Any, BaseException | None]] = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._closed = False
        self.inflight = 0

    def submit(self, job: Callable[[], Any], done: Done) -> bool:
        """Run job() on a worker and done(result, exc) later on the loop thread; False once closed."""
        with self._lock:
            if self._closed:
                return False
            self.inflight += 1

            def run() -> None:
                try:
                    res, exc = job(), None
                except BaseException as e:  # noqa: BLE001 - delivered to the loop, which decides
                    res, exc = None, e
                self._done.put((done, res, exc))
                self.wake()

            self._pool.submit(run)
        return True

    def wake(self) -> None:
        """Wake the loop's poll (safe from any thread and from signal handlers)."""
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass  # the pipe is full: the loop is woken already

    def drain(self) -> int:
        """Run every queued completion on this (the loop) thread; returns how many ran."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        n = 0
        while True:
            try:
                done, res, exc = self._done.get_nowait()
            except queue.Empty:
                return n
            self.inflight -= 1
            n += 1
            try:
                done(res, exc)
            except Exception:  # a bug in one completion must not take the loop down
                log.exception("internal error in a worker completion")

    def close(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Accept no more jobs, wait for running ones, then run their completions. `meanwhile`: the loop's own wait
        for a while (it wakes on a completion), called until every job's completion ran, each as it comes."""
        with self._lock:
            self._closed = True
        if meanwhile is not None:  # the pool is waited for on a thread of its own, the loop thread goes on
            waiter = threading.Thread(target=self._pool.shutdown, name="hkv-io-close")
            waiter.start()
            while waiter.is_alive():
                meanwhile()
                self.drain()
        self._pool.shutdown(wait=True)
        self.drain()

    def release(self) -> None:
        for fd in (self.wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
