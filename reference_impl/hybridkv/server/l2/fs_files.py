"""The filesystem L2's directory: every syscall on it, through directory fds, never following a symlink.

The base directory (the path the operator named) is opened once; its lock file and its 256 fan-out
subdirectories are opened relative to it with O_NOFOLLOW, and object files relative to those, so a
symlink planted inside the directory can neither send a write nor an unlink outside it. Payloads move
with O_DIRECT when the file system takes it (the arena's slots are page-aligned), so a spill or a
reload costs one DMA and no page-cache copy; the unaligned tail and the header go through the page cache.

Layout of the directory (see L2.md for the header and the durability guarantees):

    <dir>/.lock                      flock held by the one FilesystemL2 that owns the directory
    <dir>/<kk>/<key hex>-<group>.obj objects; <kk> is the key's first byte in hex (256 subdirectories)
    <dir>/<kk>/.tmp-<pid>-<random>   a put in progress; never an object, removed on start
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hybridkv.model.layout import MAX_GROUPS
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.header import BadObject, ObjectHeader, crc32

TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
DATA_OFFSET = 4096   # payload offset in a file: the header block, so the payload is O_DIRECT-aligned
_ALIGN = 4096        # O_DIRECT buffer, offset and length alignment (the largest logical block in use)
_PIECE = 16 << 20   # bytes per read syscall, so the checksum of one piece overlaps the read of the next
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_OBJ_NAME = re.compile(r"([0-9a-f]{32})-(0|[1-9][0-9]?)\.obj")  # a group below layout.MAX_GROUPS (64)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class ObjectDir:
    """The L2 directory: lock, subdirectory fds, object file I/O, one shared sync per batch of puts."""

    def __init__(self, directory: Path, direct: bool = True) -> None:
        self.directory = directory
        self.base_fd = self._open_base(directory)
        self._fds: list[int] = []
        self.lock_fd = -1
        try:
            self.lock_fd = self._lock()
            for i in range(256):
                self._fds.append(self._open_sub(f"{i:02x}"))
            st = os.fstatvfs(self.base_fd)
            self.block = max(st.f_frsize or st.f_bsize, 512)
        except BaseException:
            self.close()
            raise
        self.direct = bool(direct and _O_DIRECT)
        self._sync = _GroupSync(self.base_fd)
        self._crc_pool = ThreadPoolExecutor(4, thread_name_prefix="l2-crc")

    # ---- opening ----

    @staticmethod
    def _open_base(d: Path) -> int:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            raise L2Error(f"L2 path {d} exists and is not a directory") from None
        except OSError as e:
            raise L2Error(f"cannot create L2 directory {d}: {e.strerror}") from e
        try:
            fd = os.open(d, _OPEN_DIR)
        except NotADirectoryError:
            raise L2Error(f"L2 path {d} is not a directory") from None
        except OSError as e:
            raise L2Error(f"cannot open L2 directory {d}: {e.strerror}") from e
        if not os.access(d, os.W_OK | os.X_OK):
            os.close(fd)
            raise L2Error(f"L2 directory {d} is not writable")
        return fd

    def _lock(self) -> int:
        d = self.directory
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=self.base_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise L2Error(f"L2 lock file {d / LOCK_NAME} is a symlink: refusing to follow it; remove it") from None
            raise L2Error(f"cannot create lock file in L2 directory {d}: {e.strerror}") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise L2Error(f"L2 lock file {d / LOCK_NAME} is not a regular file")
        try:
            # Two stores on one directory would delete each other's temp files and double-count
            # capacity. flock dies with the process, so a SIGKILLed owner never blocks a restart.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise L2Error(f"L2 directory {d} is in use by another FilesystemL2 (lock {d / LOCK_NAME} held)") from None
        return fd

    def _open_sub(self, name: str) -> int:
        try:
            os.mkdir(name, 0o700, dir_fd=self.base_fd)
        except FileExistsError:
            pass
        except OSError as e:
            raise L2Error(f"cannot create L2 subdirectory {self.directory / name}: {e.strerror}") from e
        try:
            return os.open(name, _OPEN_DIR | os.O_NOFOLLOW, dir_fd=self.base_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise L2Error(f"L2 subdirectory {self.directory / name} is a symlink or not a directory: "
                              "refusing to follow it out of the L2 directory; remove it") from None
            raise L2Error(f"cannot open L2 subdirectory {self.directory / name}: {e.strerror}") from e

    def close(self) -> None:
        if hasattr(self, "_crc_pool"):
            self._crc_pool.shutdown(wait=True)
        for fd in [*self._fds, self.lock_fd, self.base_fd]:
            if fd >= 0:
                os.close(fd)
        self._fds, self.lock_fd, self.base_fd = [], -1, -1

    @staticmethod
    def name(key: bytes, group: int) -> str:
        return f"{key.hex()}-{group}.obj"

    @staticmethod
    def parse_name(name: str) -> tuple[bytes, int] | None:
        """The (key, group) an object file's name stands for, or None for a name that is not an object's."""
        m = _OBJ_NAME.fullmatch(name)
        return None if m is None or int(m[2]) >= MAX_GROUPS else (bytes.fromhex(m[1]), int(m[2]))

    def path(self, key: bytes, group: int) -> Path:
        """For messages only: every syscall goes through the subdirectory's fd."""
        return self.directory / key.hex()[:2] / self.name(key, group)

    def disk_bytes(self, payload: int) -> int:
        """What an object of `payload` bytes occupies on disk: its header block and payload, block-rounded."""
        return DATA_OFFSET + _round_up(payload, self.block)

    # ---- object files ----

    def write_temp(self, key: bytes, group: int, ns: bytes, payload: memoryview, stamp: int) -> tuple[str, int]:
        """Write a new temp file (header block + payload) beside the object's name.

        Returns its name and how many payload bytes went with O_DIRECT.

        The payload's crc32 is computed on a helper thread while the payload is on its way to the disk
        (the checksum and the writes both release the GIL), and the header holding it is written last.
        """
        sub = self._fds[key[0]]
        tmp = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=sub)
        try:
            try:
                crc = self._crc_pool.submit(crc32, payload, 0)
                try:
                    direct = self._write_payload(fd, payload)
                finally:
                    payload_crc = crc.result()
                header = ObjectHeader(ns, key, group, payload.nbytes, payload_crc)
                _pwrite_all(fd, header.pack(DATA_OFFSET), 0)
                os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
        except BaseException:
            self.unlink(key, tmp)
            raise
        return tmp, direct

    def _write_payload(self, fd: int, payload: memoryview) -> int:
        """Write the payload at DATA_OFFSET: O_DIRECT for its aligned part when the file system takes it.
        Returns the bytes written with O_DIRECT."""
        n = payload.nbytes
        bulk = n - n % _ALIGN if self.direct and _address(payload) % _ALIGN == 0 else 0
        if bulk:
            dfd = _reopen_direct(fd, os.O_WRONLY)
            if dfd < 0:
                bulk = 0
            else:
                try:
                    _pwrite_all(dfd, payload[:bulk], DATA_OFFSET)
                finally:
                    os.close(dfd)
        if bulk < n:
            _pwrite_all(fd, payload[bulk:], DATA_OFFSET + bulk)
        return bulk

    def read_into(self, key: bytes, group: int, out: memoryview, stamp: int, ns: bytes | None = None) -> int:
        """Fill `out` with the object's payload; raises BadObject or OSError when it cannot be trusted (or its
        header names another namespace than `ns`, which the index said it was). Returns the payload bytes read
        with O_DIRECT."""
        fd = _open_object(self.name(key, group), self._fds[key[0]])
        try:
            raw = os.pread(fd, DATA_OFFSET, 0)
            hdr = ObjectHeader.unpack(raw, DATA_OFFSET)
            hdr.check_for(key, group, out.nbytes, ns)
            size = os.fstat(fd).st_size
            if size != DATA_OFFSET + hdr.payload_len:
                raise BadObject(f"file is {size} bytes, header says {DATA_OFFSET} + {hdr.payload_len}")
            crc, direct = self._read_payload(fd, out)
            if crc != hdr.payload_crc:
                raise BadObject("payload checksum mismatch")
            try:
                os.utime(fd, ns=(stamp, stamp))  # the LRU position, for the next restart
            except OSError:
                pass
        finally:
            os.close(fd)
        return direct

    def _read_payload(self, fd: int, out: memoryview) -> tuple[int, int]:
        """Read the payload into `out` piece by piece; the crc32 of each piece runs on a helper thread
        while the next is read, so a reload costs about max(read, checksum), not their sum.
        Returns (crc32, bytes read with O_DIRECT)."""
        n = out.nbytes
        bulk = n - n % _ALIGN if self.direct and _address(out) % _ALIGN == 0 else 0
        dfd = _reopen_direct(fd, os.O_RDONLY) if bulk else -1
        if dfd < 0:
            bulk = 0
        crc: Future[int] | None = None
        pos = 0
        try:
            while pos < n:
                end = min(pos + _PIECE, bulk if pos < bulk else n)
                piece = out[pos:end]
                _pread_exact(dfd if pos < bulk else fd, piece, DATA_OFFSET + pos)
                crc = self._crc_pool.submit(_crc_after, crc, piece)
                pos = end
        finally:
            if dfd >= 0:
                os.close(dfd)
            value = crc.result() if crc is not None else 0
        return value, bulk

    def read_header(self, sub_index: int, name: str) -> tuple[ObjectHeader, int, int]:
        """(header, file size, mtime ns) of one object file, for the index rebuild."""
        fd = _open_object(name, self._fds[sub_index])
        try:
            st = os.fstat(fd)
            return ObjectHeader.unpack(os.pread(fd, DATA_OFFSET, 0), DATA_OFFSET), st.st_size, st.st_mtime_ns
        finally:
            os.close(fd)

    def check_object(self, sub_index: int, name: str, key: bytes, group: int) -> tuple[ObjectHeader, int]:
        """The header and mtime of object file `name` (named for key, group) in a subdirectory; BadObject
        when its name, its header or its size says it is not that object."""
        if key[0] != sub_index or name != self.name(key, group):
            raise BadObject(f"name is not canonical for its key/group or subdirectory {sub_index:02x}")
        hdr, size, mtime = self.read_header(sub_index, name)
        if hdr.key != key or hdr.group != group:
            raise BadObject(f"named for {key.hex()}-{group} but its header is for {hdr.key.hex()}-{hdr.group}")
        if size != DATA_OFFSET + hdr.payload_len:
            raise BadObject(f"file is {size} bytes, header says {DATA_OFFSET} + {hdr.payload_len}")
        return hdr, mtime

    def rename(self, key: bytes, tmp: str, name: str) -> None:
        sub = self._fds[key[0]]
        os.rename(tmp, name, src_dir_fd=sub, dst_dir_fd=sub)  # replaces a symlink, never follows it

    def unlink(self, key: bytes, name: str) -> None:
        """Unlink a name that may already be gone (evicted twice, removed by a concurrent clear)."""
        try:
            os.unlink(name, dir_fd=self._fds[key[0]])
        except FileNotFoundError:
            pass

    def unlink_in(self, sub_index: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._fds[sub_index])
        except FileNotFoundError:
            pass

    def stamp(self, key: bytes, name: str, stamp: int) -> None:
        os.utime(name, ns=(stamp, stamp), dir_fd=self._fds[key[0]], follow_symlinks=False)

    def scan(self, sub_index: int) -> Iterator[os.DirEntry]:
        with os.scandir(self._fds[sub_index]) as it:
            yield from it

    def sync(self) -> None:
        """Make every write and rename done before this call durable; concurrent callers share one syncfs."""
        self._sync.sync()

    @property
    def sync_calls(self) -> int:
        return self._sync.calls

    def free_bytes(self) -> int:
        st = os.fstatvfs(self.base_fd)
        return st.f_bavail * st.f_frsize


class _GroupSync:
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


def _crc_after(prev: Future[int] | None, piece: memoryview) -> int:
    """crc32 of `piece` continuing the crc of everything before it (chained futures keep the order)."""
    return crc32(piece, prev.result() if prev is not None else 0)


def _open_object(name: str, dir_fd: int) -> int:
    """A read-only fd on object file `name`, BadObject when it is not a regular file: opened non-blocking and
    checked before any read, as a FIFO in an object's place would block the thread (its L2 reads, shutdown)."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadObject("not a regular file")
    os.set_blocking(fd, True)
    return fd


def _address(buf: memoryview) -> int:
    """The buffer's address (read-only ones included), to decide whether O_DIRECT may use it."""
    return int(np.frombuffer(buf, np.uint8).ctypes.data) if buf.nbytes else 0


def _reopen_direct(fd: int, mode: int) -> int:
    """A second fd on the same inode with O_DIRECT, or -1 when the file system does not take it (tmpfs)."""
    if not _O_DIRECT:
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", mode | _O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


def _pwrite_all(fd: int, buf: memoryview | bytes, offset: int) -> None:
    view = memoryview(buf)
    pos = 0
    while pos < len(view):
        n = os.pwrite(fd, view[pos:], offset + pos)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite returned {n} at offset {offset + pos}")
        pos += n


def _pread_exact(fd: int, out: memoryview, offset: int) -> None:
    pos = 0
    while pos < out.nbytes:
        n = os.preadv(fd, [out[pos:]], offset + pos)
        if n <= 0:
            raise BadObject(f"file ends at {offset + pos}, {out.nbytes - pos} payload bytes short")
        pos += n
