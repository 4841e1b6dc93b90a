"""An engine's mapping of the server's arena populated ahead of use, on a thread of its own.

The first read of an arena page in a new engine process traps into the kernel (a minor fault per 16 pages, with
the kernel's fault-around), and every warm request of a new engine reads pages it never read: most of a CPU load's
time went to those faults, on the request's time to first token. On CUDA registering the
arena as pinned memory populates it already; a CPU engine asks the kernel to (`MADV_POPULATE_READ`, Linux 5.14+)
at registration, in slices, off vLLM's step. The server allocated the arena whole (`posix_fallocate`): this maps
pages, it commits no memory. An older kernel refuses the advice: pages then fault in on first use, as before.
"""

from __future__ import annotations

import ctypes
import sys
import threading

MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14+
SLICE = 16 << 20  # per call: a close waits for one slice at most


class Prefault:
    """Populates `size` bytes mapped at `address` on a daemon thread; `done` is set when it ended (populated,
    refused by the kernel, or stopped)."""

    def __init__(self, address: int, size: int, name: str = "hkv-arena-prefault"):
        self.done = threading.Event()
        self.populated = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, size), name=name, daemon=True)
        self._thread.start()

    def _run(self, address: int, size: int) -> None:
        try:
            if not sys.platform.startswith("linux"):
                return
            madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: the GIL is released during it
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            for off in range(0, size, SLICE):
                if self._stop.is_set() or madvise(address + off, min(SLICE, size - off), MADV_POPULATE_READ):
                    return
            self.populated = True
        finally:
            self.done.set()

    def stop(self) -> None:
        """Stop populating (before the mapping goes away) and wait for the slice in flight."""
        self._stop.set()
        self._thread.join()
