"""The L1 arena: one shared-memory file that engines on this host map, carved into object slots.

The server creates the file (mode 0600) and hands its path to engines, which map it and, on CUDA,
register it as pinned memory so the GPU copies straight into it. The server itself never copies
payload bytes on that path; it only hands out (offset, length) slots.
"""

from __future__ import annotations

import bisect
import mmap
import os
import secrets
from pathlib import Path

SLOT_ALIGN = 4096  # page-aligned slots: DMA and 16-byte vector access both want it


class ArenaError(RuntimeError):
    """The arena cannot be created or mapped as asked."""


def shm_free_bytes(directory: str | Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class Arena:
    """A shared-memory file mapped read-write by this process."""

    def __init__(self, size: int, directory: str | Path = "/dev/shm", prefix: str = "hybridkv"):
        if size < SLOT_ALIGN:
            raise ArenaError(f"L1 size {size} B is smaller than one {SLOT_ALIGN} B slot")
        directory = Path(directory)
        if not directory.is_dir():
            raise ArenaError(f"arena directory {directory} does not exist")
        free = shm_free_bytes(directory)
        # tmpfs allocates on first touch; a file larger than the mount's free space would SIGBUS later.
        if size > free:
            raise ArenaError(f"L1 size {size / 2**30:.2f} GiB exceeds the {free / 2**30:.2f} GiB free "
                             f"in {directory}; lower --l1-gib or enlarge the mount")
        self.size = size
        self.path = directory / f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}.arena"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise ArenaError(f"cannot map {size} B at {self.path}: {e}") from e
        os.close(fd)
        self.buf = memoryview(self._mm)

    def view(self, offset: int, length: int) -> memoryview:
        return self.buf[offset:offset + length]

    def close(self) -> None:
        """Unmap and unlink; engines that still map the file keep their mapping until they unmap."""
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:
            # A payload frame still references the mapping (zero-copy send in flight); the OS frees it at exit.
            pass
        self.path.unlink(missing_ok=True)


def map_arena(path: str | Path, size: int, writable: bool = True) -> mmap.mmap:
    """Map a server's arena file (the engine side of the shm wire format)."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ArenaError(f"cannot open the server's arena {path}: {e}") from e
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ArenaError(f"arena {path} is {actual} B, the server announced {size} B")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


class ExtentAllocator:
    """First-fit allocator of aligned extents over [0, size), coalescing freed neighbours."""

    def __init__(self, size: int, align: int = SLOT_ALIGN):
        self.align = align
        self.size = size - size % align
        self._starts: list[int] = [0] if self.size else []
        self._len: dict[int, int] = {0: self.size} if self.size else {}
        self._by_end: dict[int, int] = {self.size: 0} if self.size else {}
        self.free_bytes = self.size

    def rounded(self, length: int) -> int:
        return -(-length // self.align) * self.align

    def alloc(self, length: int) -> int | None:
        """An offset of `length` free bytes (rounded up to the alignment), or None."""
        need = self.rounded(max(length, 1))
        for start in self._starts:
            have = self._len[start]
            if have >= need:
                self._remove(start)
                if have > need:
                    self._insert(start + need, have - need)
                self.free_bytes -= need
                return start
        return None

    def free(self, offset: int, length: int) -> None:
        """Return an extent given by alloc; merges it with free neighbours."""
        length = self.rounded(max(length, 1))
        if offset % self.align or offset < 0 or offset + length > self.size:
            raise ValueError(f"extent ({offset}, {length}) was never allocated from this arena")
        self.free_bytes += length
        end = offset + length
        if offset in self._by_end:  # left neighbour
            left = self._by_end[offset]
            length += self._len[left]
            self._remove(left)
            offset = left
        if end in self._len:  # right neighbour
            length += self._len[end]
            self._remove(end)
        self._insert(offset, length)

    def largest_free(self) -> int:
        return max(self._len.values(), default=0)

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._len[start] = length
        self._by_end[start + length] = start

    def _remove(self, start: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        length = self._len.pop(start)
        del self._by_end[start + length]
