"""Group commit for the filesystem L2: a put that must be durable waits for one syncfs that started after its writes,
and concurrent puts share it, so small objects do not pay one disk flush each."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


class GroupSync:
    """Group commit: a caller waits for one syncfs that started after its writes; one runs at a time."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._cv = threading.Condition()
        self._asked = 0    # tickets handed out
        self._synced = 0   # every ticket <= this is durable
        self._running = False
        self.calls = 0     # syncfs calls made: fewer than callers when puts overlap

    def sync(self) -> None:
        with self._cv:
            self._asked += 1
            ticket = self._asked
            while self._synced < ticket:
                if self._running:
                    self._cv.wait()
                    continue
                self._running = True
                self.calls += 1
                covers = self._asked  # every write of these tickets finished before they asked
                self._cv.release()
                try:
                    _syncfs_or_sync(self._fd)
                finally:
                    self._cv.acquire()
                    self._running = False
                    self._cv.notify_all()
                self._synced = max(self._synced, covers)


def _syncfs_or_sync(fd: int) -> None:
    if _syncfs is None:
        os.sync()
        return
    if _syncfs(fd) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"syncfs: {os.strerror(e)}")
