"""The L1 arena: one shared-memory file that engines on this host map, carved into object slots.

The server creates the file (mode 0600) and hands its path to engines, which map it and, on CUDA,
register it as pinned memory so the GPU copies straight into it. The server itself never copies
payload bytes on that path; it only hands out (offset, length) slots.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import mmap
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from hybridkv.memory.memory_room import check_room

SLOT_ALIGN = 4096  # page-aligned slots: DMA and 16-byte vector access both want it


class ArenaError(RuntimeError):
    """The arena cannot be created or mapped as asked."""


def shm_free_bytes(directory: str | Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class Arena:
    """A shared-memory file mapped read-write by this process."""

    def __init__(self, size: int, directory: str | Path = "/dev/shm", prefix: str = "hybridkv",
                 fence_bytes: int = 0, sealed: bool = False):
        """`size`: the slots' bytes; `fence_bytes` (a multiple of SLOT_ALIGN) more follow them in the file, the
        fence words (`hybridkv.server.books.fences`): engines map the whole file (`file_bytes`), slots lie below
        `size`. `sealed`: a memfd sealed against shrinking instead of a file in `directory` (`_sealed_memfd`)."""
        if fence_bytes % SLOT_ALIGN or fence_bytes < 0:
            raise ArenaError(f"fence region {fence_bytes} B is not a multiple of {SLOT_ALIGN} B")
        if size < SLOT_ALIGN:
            raise ArenaError(f"L1 size {size} B is smaller than one {SLOT_ALIGN} B slot")
        directory = Path(directory)
        if not sealed and not directory.is_dir():
            raise ArenaError(f"arena directory {directory} does not exist")
        # the quick answer, before a byte is taken: the mount's free space, the RAM and the memory cgroup's room
        # (memory_room says why all three); posix_fallocate below is the one that holds when others share them.
        # A memfd lies on the kernel's own tmpfs, which has no size: the RAM and the cgroup alone bound it.
        free = 1 << 62 if sealed else shm_free_bytes(directory)
        refused = check_room(size + fence_bytes + SLOT_ALIGN, "a memfd" if sealed else directory, free)
        if refused:
            raise ArenaError(refused)
        self.size = size
        # the fence words start on a page boundary above the slots (the slots' allocator rounds `size` down)
        self.fence_base = -(-size // SLOT_ALIGN) * SLOT_ALIGN
        self.file_bytes = self.fence_base + fence_bytes if fence_bytes else size
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self.sealed = sealed
        if sealed:
            self._fd, self.path = _sealed_memfd(name, self.file_bytes)
            self._mm = mmap.mmap(self._fd, self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.buf = memoryview(self._mm)
            return
        # Created under a temporary name and locked before it gets its final one, so a starting server that
        # sweeps dead arenas (remove_dead_arenas) never sees an arena whose owner has not locked it yet.
        tmp = directory / f".{name}{CREATING_SUFFIX}"
        self.path = directory / f"{name}{ARENA_SUFFIX}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives: "owner alive"
            os.ftruncate(fd, self.file_bytes)
            # tmpfs allocates a page on first touch, and a touch the mount cannot back is SIGBUS, not an
            # error: whoever fills the mount after our start would kill the server (and any shm engine
            # mid-copy). Backing every page now turns that into ENOSPC here, before anything is served.
            os.posix_fallocate(fd, 0, self.file_bytes)
            self._mm = mmap.mmap(fd, self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.rename(tmp, self.path)
        except OSError as e:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise ArenaError(f"L1 size {size / 2**30:.2f} GiB does not fit in {directory} "
                                 f"({shm_free_bytes(directory) / 2**30:.2f} GiB free once others took "
                                 "their share); lower --l1-gib or enlarge the mount") from None
            raise ArenaError(f"cannot map {self.file_bytes} B at {self.path}: {e}") from e
        self._fd = fd  # kept open: the lock lasts exactly as long as this process or close()
        self.buf = memoryview(self._mm)

    def view(self, offset: int, length: int) -> memoryview:
        return self.buf[offset:offset + length]

    def close(self) -> None:
        """Unmap and unlink; engines that still map the file keep their mapping until they unmap. Idempotent. (A
        memfd has no name to unlink: its memory goes once no process holds or maps it.)"""
        if not self.sealed:
            self.path.unlink(missing_ok=True)
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:
            # A payload frame still references the mapping (zero-copy send in flight); the OS frees it at exit.
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _sealed_memfd(name: str, file_bytes: int) -> tuple[int, Path]:
    """A memfd of `file_bytes`, every page backed, sealed so that nobody can shrink or grow it, and the path engines
    open it by: `/proc/<our pid>/fd/<fd>`, which a process of our uid opens as it would the file (the link leads
    to the memfd itself; `map_arena` opens without O_NOFOLLOW). A process that may write a named arena file may
    truncate it, and the server's next copy past the new end is a SIGBUS; a shrink of this one fails with EPERM.
    It needs engines in the server's pid namespace (a container that shares only /dev/shm sees no /proc/<pid>)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, file_bytes)
        os.posix_fallocate(fd, 0, file_bytes)  # as for a file: a page the RAM cannot back fails here, not at a copy
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except OSError as e:
        os.close(fd)
        raise ArenaError(f"cannot back a sealed memfd arena of {file_bytes} B: {e}") from e
    return fd, Path(f"/proc/{os.getpid()}/fd/{fd}")


ARENA_SUFFIX = ".arena"
CREATING_SUFFIX = ".creating"  # `.hybridkv-<pid>-<hex>.creating`: an arena being backed, named once it is


def _pid_alive(name: str) -> bool:
    """Whether the pid in an arena name (`hybridkv-<pid>-<hex>.arena`) is a live process (True if unreadable)."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_arenas(directory: str | Path, prefix: str = "hybridkv") -> list[Path]:
    """Unlink arena files in `directory` whose server is gone (killed with -9, crashed): a live server
    holds a lock on its arena for as long as it runs, so a file we can lock, named for a dead pid, has
    no owner. (The pid check spares servers of older versions, which hold no lock.) Arenas still being
    created count too: a server killed while backing its arena (the OOM killer) leaves it under that name."""
    removed: list[Path] = []
    directory = Path(directory)
    for path in [*directory.glob(f"{prefix}-*{ARENA_SUFFIX}"), *directory.glob(f".{prefix}-*{CREATING_SUFFIX}")]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # vanished, a symlink, or not ours to open
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its server is alive
            if _pid_alive(path.name):
                continue  # unlocked but its process lives: a server older than the lock; never ours to remove
            # Still the same file (not replaced between our open and now)? Then nobody owns it.
            if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
                path.unlink(missing_ok=True)
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


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


class SortedStarts:
    """Integers in ascending order, kept in runs of at most 2 x RUN: adding or removing one moves the items of one
    run, not of all (the free extents' starts, one sorted list, moved megabytes per call at hundreds of thousands
    of extents: a Clear of half an arena's objects spent most of its seconds there)."""
    RUN = 1024
    __slots__ = ("_runs", "_maxes")

    def __init__(self) -> None:
        self._runs: list[list[int]] = []
        self._maxes: list[int] = []  # each run's last

    def __iter__(self) -> Iterator[int]:
        for run in self._runs:
            yield from run

    def add(self, x: int) -> None:
        runs, maxes = self._runs, self._maxes
        if not runs:
            runs.append([x])
            maxes.append(x)
            return
        i = min(bisect.bisect_left(maxes, x), len(maxes) - 1)
        run = runs[i]
        bisect.insort(run, x)
        maxes[i] = run[-1]
        if len(run) > 2 * self.RUN:
            half = run[self.RUN:]
            del run[self.RUN:]
            runs.insert(i + 1, half)
            maxes[i] = run[-1]
            maxes.insert(i + 1, half[-1])

    def remove(self, x: int) -> None:
        """Take `x` out (ValueError when it is not held)."""
        maxes = self._maxes
        i = bisect.bisect_left(maxes, x)
        run = self._runs[i] if i < len(maxes) else []
        j = bisect.bisect_left(run, x)
        if j == len(run) or run[j] != x:
            raise ValueError(f"{x} is not held")
        del run[j]
        if run:
            maxes[i] = run[-1]
        else:
            del self._runs[i], maxes[i]


class ExtentAllocator:
    """First-fit allocator of aligned extents over [0, size), coalescing freed neighbours."""

    def __init__(self, size: int, align: int = SLOT_ALIGN):
        self.align = align
        self.size = size - size % align
        self._starts = SortedStarts()
        if self.size:
            self._starts.add(0)
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
        self._starts.add(start)
        self._len[start] = length
        self._by_end[start + length] = start

    def _remove(self, start: int) -> None:
        self._starts.remove(start)
        length = self._len.pop(start)
        del self._by_end[start + length]
