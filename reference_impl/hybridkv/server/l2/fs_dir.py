"""The filesystem L2's directory: its layout, how it is opened and locked, and every syscall on it, through
directory fds, never following a symlink.

The base directory (the path the operator named) is opened once; its lock file and its 256 fan-out
subdirectories are opened relative to it with O_NOFOLLOW, and object files relative to those, so a
symlink planted inside the directory can neither send a write nor an unlink outside it. What is inside one
object file is `fs_record`'s; when a put is durable is `fs_sync`'s.

Layout of the directory (see L2.md for the header and the durability guarantees):

    <dir>/.lock                      flock held by the one FilesystemL2 that owns the directory
    <dir>/<kk>/<key hex>-<group>.obj objects; <kk> is the key's first byte in hex (256 subdirectories)
    <dir>/<kk>/.tmp-<pid>-<random>   a put in progress; never an object, removed on start
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hybridkv.model.layout import MAX_GROUPS
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.fs_record import (
    HAS_O_DIRECT,
    NOFOLLOW,
    check_header,
    disk_bytes,
    header_of,
    open_record,
    read_record,
    write_record,
)
from hybridkv.server.l2.fs_sync import GroupSync
from hybridkv.server.l2.header import BadObject, ObjectHeader

log = logging.getLogger("hybridkv.server.l2.fs")  # the adapter's log: one logger for its lines

TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_OBJ_NAME = re.compile(r"([0-9a-f]{32})-(0|[1-9][0-9]?)\.obj")  # a group below layout.MAX_GROUPS (64)


@dataclass(frozen=True, slots=True)
class Found:
    """An object file that passed the start-up checks: what the index needs of it."""

    mtime: int  # ns: its LRU position
    name: str
    key: bytes
    group: int
    ns: bytes
    payload_len: int


@dataclass(frozen=True, slots=True)
class Survey:
    """What the directory held on start: its valid objects, oldest first, and the files removed."""

    found: list[Found]
    tmp_removed: int
    bad_removed: int


class ObjectDir:
    """The L2 directory: lock, subdirectory fds, the object files' syscalls (what a file holds: `fs_record`), one
    shared sync per batch of puts (`fs_sync`)."""

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
        self.direct = bool(direct and HAS_O_DIRECT)
        self._sync = GroupSync(self.base_fd)
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
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600, dir_fd=self.base_fd)
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
        return disk_bytes(payload, self.block)

    # ---- object files ----

    def write_temp(self, key: bytes, group: int, ns: bytes, payload: memoryview, stamp: int) -> tuple[str, int]:
        """Write a new temp file (`fs_record`: header block + payload) beside the object's name.

        Returns its name and how many payload bytes went with O_DIRECT."""
        sub = self._fds[key[0]]
        tmp = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=sub)
        try:
            try:
                direct = write_record(fd, key, group, ns, payload, stamp, self.direct, self._crc_pool)
            finally:
                os.close(fd)
        except BaseException:
            self.unlink(key, tmp)
            raise
        return tmp, direct

    def read_into(self, key: bytes, group: int, out: memoryview, stamp: int, ns: bytes | None = None) -> int:
        """Fill `out` with the object's payload; raises BadObject or OSError when it cannot be trusted (or its
        header names another namespace than `ns`, which the index said it was). Returns the payload bytes read
        with O_DIRECT."""
        fd = open_record(self.name(key, group), self._fds[key[0]])
        try:
            return read_record(fd, key, group, out, stamp, ns, self.direct, self._crc_pool)
        finally:
            os.close(fd)

    def read_header(self, sub_index: int, name: str) -> tuple[ObjectHeader, int, int]:
        """(header, file size, mtime ns) of one object file, for the index rebuild."""
        fd = open_record(name, self._fds[sub_index])
        try:
            return header_of(fd)
        finally:
            os.close(fd)

    def check_object(self, sub_index: int, name: str, key: bytes, group: int) -> tuple[ObjectHeader, int]:
        """The header and mtime of object file `name` (named for key, group) in a subdirectory; BadObject
        when its name, its header or its size says it is not that object."""
        if key[0] != sub_index or name != self.name(key, group):
            raise BadObject(f"name is not canonical for its key/group or subdirectory {sub_index:02x}")
        hdr, size, mtime = self.read_header(sub_index, name)
        check_header(hdr, size, key, group)
        return hdr, mtime

    def survey(self, capacity_bytes: int) -> Survey:
        """Every valid object file, oldest first (by mtime, then name), from its header alone; temp files (puts
        killed before their rename, never acknowledged) and bad files (a bad name, header or size, or larger than
        `capacity_bytes` on disk, which a put refuses) are removed."""
        found: list[Found] = []
        tmp_removed = bad_removed = 0
        for i in range(256):
            for de in self.scan(i):
                if de.name.startswith(TMP_PREFIX):
                    self.unlink_in(i, de.name)
                    tmp_removed += 1
                    continue
                oid = self.parse_name(de.name)
                if oid is None or not de.is_file(follow_symlinks=False):
                    log.warning("L2: ignoring %s/%02x/%s, not an object file", self.directory, i, de.name)
                    continue
                key, group = oid
                try:
                    hdr, mtime = self.check_object(i, de.name, key, group)
                    if self.disk_bytes(hdr.payload_len) > capacity_bytes:  # put() refuses one as large
                        raise BadObject(f"its {hdr.payload_len} B payload outgrows the L2 ({capacity_bytes} B)")
                except (BadObject, OSError) as e:
                    log.warning("L2: removing bad object file %s/%02x/%s: %s", self.directory, i, de.name, e)
                    self.unlink_in(i, de.name)
                    bad_removed += 1
                    continue
                found.append(Found(mtime, de.name, key, group, hdr.ns, hdr.payload_len))
        found.sort(key=lambda f: (f.mtime, f.name))
        return Survey(found, tmp_removed, bad_removed)

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
