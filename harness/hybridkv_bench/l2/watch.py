"""When did the last spilled object reach L2? Watches that cost the host (almost) nothing meanwhile.

The spill is over when the last object is in L2, not when the server process has exited (closing an
arena of tens of GB and the interpreter's exit are not L2 work). A filesystem L2 is watched with
inotify (the kernel reports each rename onto an object name; the watcher sleeps in between), so the
watch takes no CPU from the server it times: rescanning 256 subdirectories every few ms takes a sizeable
share of a core, which a small host cannot spare. Redis is polled (SCAN of the metas) instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

_IN_MOVED_TO = 0x80
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name


class Watch:
    """Polls how many objects L2 holds, from another thread, and notes when it reaches `want`."""

    def __init__(self, count: Callable[[], int], want: int) -> None:
        self.count, self.want, self.seen = count, want, 0
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen = self.count()
            if self.seen >= self.want:
                self.at = time.perf_counter()
                return
            time.sleep(0.005)

    def done_at(self, t0: float) -> float | None:
        """Seconds from t0 until every object was in L2 (after one last look), or None."""
        self._stop.set()
        self._thread.join()
        if self.at is None and self.count() >= self.want:
            self.at = time.perf_counter()
        return None if self.at is None else self.at - t0


class DirWatch:
    """Counts distinct `*.obj` names in the L2 directory's subdirectories through inotify."""

    def __init__(self, l2_dir: Path, want: int) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.want = want
        self.at: float | None = None
        self._names: set[str] = set()
        self._fd = libc.inotify_init1(_IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        subs = [p for p in sorted(Path(l2_dir).iterdir()) if p.is_dir() and not p.is_symlink()]
        try:
            for p in subs:  # watches first, then the scan: no rename falls between the two
                if libc.inotify_add_watch(self._fd, os.fsencode(p), _IN_MOVED_TO) < 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"inotify_add_watch {p}: {os.strerror(e)}")
            for p in subs:
                self._names.update(f.name for f in os.scandir(p) if f.name.endswith(".obj"))
        except BaseException:
            os.close(self._fd)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def seen(self) -> int:
        return len(self._names)

    def _run(self) -> None:
        while not self._stop.is_set() and len(self._names) < self.want:
            if not select.select([self._fd], [], [], 0.1)[0]:
                continue
            buf = os.read(self._fd, 1 << 16)
            pos = 0
            while pos < len(buf):
                _, mask, _, n = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size:pos + _EVENT.size + n].rstrip(b"\0").decode(errors="replace")
                pos += _EVENT.size + n
                if mask & _IN_MOVED_TO and name.endswith(".obj"):
                    self._names.add(name)
        if len(self._names) >= self.want:
            self.at = time.perf_counter()

    def done_at(self, t0: float) -> float | None:
        """Seconds from t0 until `want` objects had been renamed into place, or None."""
        self._stop.set()
        self._thread.join()
        os.close(self._fd)
        return None if self.at is None else self.at - t0


def redis_counter(url: str, prefix: str) -> Callable[[], int]:
    import redis

    r = redis.Redis.from_url(url, socket_timeout=10)
    return lambda: sum(1 for _ in r.scan_iter(match=f"{prefix}m:*", count=10_000))
