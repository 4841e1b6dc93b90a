"""Filesystem L2: one file per object, written to a temp name and renamed, checked on every read.

Layout of the directory (see L2.md for the header table and the durability guarantees):

    <dir>/.lock                      flock held by the one FilesystemL2 that owns the directory
    <dir>/<kk>/<key hex>-<group>.obj objects; <kk> is the key's first byte in hex (256 subdirectories)
    <dir>/<kk>/.tmp-<pid>-<random>   a put in progress; never an object, removed on start

The index (object -> namespace, length, LRU position) lives in memory and is rebuilt on start from
the headers alone; payload checksums are verified on every read instead, because checksumming tens of
GB at start would delay the server by minutes.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import re
import secrets
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from hybridkv.server.l2 import (
    HEADER_BYTES,
    MAGIC,  # noqa: F401  (re-exported: tests and tools read it from here)
    BadObject,
    L2Adapter,
    L2Error,
    ObjectHeader,
    byte_view,
    check_key,
    check_ns,
)

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
_OBJ_NAME = re.compile(r"([0-9a-f]{32})-([0-9]+)\.obj")
_KEY_LOCK_STRIPES = 64
# LRU stamps are file mtimes; successive stamps differ by at least 1 us so that file systems which
# keep microseconds (not nanoseconds) still order them after a restart.
_STAMP_STEP_NS = 1000
_COUNTERS = ("puts", "gets", "hits", "misses", "corrupt_removed", "evictions", "bytes_written",
             "bytes_read", "tmp_removed")

# Read errors that condemn the file itself (media or file-system damage), not this process's state.
_BAD_FILE_ERRNOS = frozenset({errno.EIO, errno.ENODATA, errno.EUCLEAN, errno.EBADMSG})

ObjectKey = tuple[bytes, int]


@dataclass(slots=True)
class _Entry:
    ns: bytes
    length: int
    gen: int  # changes on every commit, so a reader can tell "my file" from "a newer file"


def _object_name(key: bytes, group: int) -> str:
    return f"{key.hex()}-{group}.obj"


def _write_all(fd: int, buf: memoryview | bytes) -> None:
    """os.write until done: one syscall moves at most ~2 GiB, and slicing a memoryview copies nothing."""
    view = memoryview(buf)
    pos = 0
    while pos < len(view):
        n = os.write(fd, view[pos:])
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n} at offset {pos}")
        pos += n


class FilesystemL2(L2Adapter):
    """L2 on a local directory: one checksummed file per object, LRU-evicted to `capacity_bytes`.

    `capacity_bytes` bounds the payload bytes held (headers, 64 B each, are not counted). With
    `fsync=True` each put also fsyncs the file and its directory, so objects survive power loss,
    not only a crash of this process.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, fsync: bool = False) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = bool(fsync)
        # One lock for the index and counters, never held across a syscall on an object file.
        self._lock = threading.Lock()
        # Signalled when a put lands or fails: puts waiting for room or for the same object retry.
        self._room = threading.Condition(self._lock)
        self._writing: set[ObjectKey] = set()  # objects whose put is between reserve and commit
        # Per-object locks (striped) order a rename against an unlink of the same path; held for
        # metadata syscalls only, never while payload bytes move.
        self._key_locks = tuple(threading.Lock() for _ in range(_KEY_LOCK_STRIPES))
        self._index: OrderedDict[ObjectKey, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._reserved = 0  # bytes of puts in flight, counted against capacity before they land
        self._gens = itertools.count(1)
        self._last_stamp = 0
        self._closed = False
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._lock_fd = self._open_directory()
        try:
            self._rebuild()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def __repr__(self) -> str:
        return (f"FilesystemL2({str(self.directory)!r}, capacity_bytes={self.capacity_bytes}, "
                f"fsync={self.fsync})")

    # ---- the L2Adapter interface ----

    def put(self, key: bytes, group: int, ns: bytes, data: memoryview | bytes) -> None:
        """Write to a temp file, then rename: a reader or a restart sees the whole object or none."""
        check_key(key, group)
        check_ns(ns)
        view = byte_view(data, writable=False)
        size = view.nbytes
        if size > self.capacity_bytes:
            raise L2Error(f"object {key.hex()}-{group} of {size} bytes exceeds L2 capacity "
                          f"{self.capacity_bytes} bytes")
        okey = (key, group)
        path = self._path(key, group)
        victims: list[ObjectKey] = []
        with self._room:
            while True:
                self._check_open()
                entry = self._index.get(okey)
                if entry is not None and entry.length == size:
                    # Keys hash the token prefix, so the same key means the same bytes: skip the write.
                    self._index.move_to_end(okey)
                    self._counters["puts"] += 1
                    stamp = self._next_stamp()
                    held = True
                    break
                held = False
                if okey in self._writing:
                    self._room.wait()  # one write per object: wait for it, then it is a no-op
                    continue
                victims += self._evict_until_fits(size)
                if self._bytes + self._reserved + size <= self.capacity_bytes:
                    self._reserved += size
                    self._writing.add(okey)
                    stamp = self._next_stamp()
                    break
                # Only puts in flight hold the room; once they land they can be evicted.
                self._room.wait()
        self._unlink_dropped(victims)
        if held:
            self._stamp_path(path, stamp)
            return
        committed = False
        try:
            header = ObjectHeader(ns, key, group, size, zlib.crc32(view)).pack()
            try:
                tmp = self._write_temp(path, header, view, stamp)
            except OSError as e:
                raise L2Error(f"cannot write L2 object {path}: {e}") from e
            with self._key_lock(okey):
                try:
                    os.rename(tmp, path)
                except OSError as e:
                    _unlink_quietly(tmp)
                    raise L2Error(f"cannot rename {tmp} to {path}: {e}") from e
                with self._room:
                    old = self._index.pop(okey, None)
                    if old is not None:
                        self._bytes -= old.length
                    self._index[okey] = _Entry(ns, size, next(self._gens))
                    self._bytes += size
                    self._counters["puts"] += 1
                    self._counters["bytes_written"] += size
                    self._release(okey, size)
                    committed = True
        finally:
            if not committed:
                with self._room:
                    self._release(okey, size)
        if self.fsync:
            try:
                self._fsync_dir(os.path.dirname(path))
            except OSError as e:
                raise L2Error(f"wrote {path} but cannot fsync its directory: {e}") from e

    def get_into(self, key: bytes, group: int, out: memoryview) -> bool:
        """Read header and payload straight into `out`, then check header, size and payload crc32."""
        check_key(key, group)
        out = byte_view(out, writable=True)
        okey = (key, group)
        with self._lock:
            self._check_open()
            entry = self._index.get(okey)
            if entry is not None and out.nbytes != entry.length:
                raise ValueError(f"out is {out.nbytes} bytes but object {key.hex()}-{group} is "
                                 f"{entry.length} bytes")
            self._counters["gets"] += 1
            if entry is None:
                self._counters["misses"] += 1
                return False
            self._index.move_to_end(okey)
            gen = entry.gen
            stamp = self._next_stamp()
        path = self._path(key, group)
        try:
            self._read_verified(path, key, group, out, stamp)
        except FileNotFoundError:
            reason = "file missing"
        except OSError as e:
            if e.errno not in _BAD_FILE_ERRNOS:
                # Out of file descriptors or memory says nothing about the file: a miss, kept.
                log.warning("L2: cannot read %s: %s", path, e)
                with self._lock:
                    self._counters["misses"] += 1
                return False
            reason = str(e)
        except BadObject as e:
            reason = str(e)
        else:
            with self._lock:
                self._counters["hits"] += 1
                self._counters["bytes_read"] += out.nbytes
            return True
        self._drop_bad(okey, gen, path, reason)
        with self._lock:
            self._counters["misses"] += 1
        return False

    def contains(self, key: bytes, group: int) -> bool:
        """Whether the index holds the object."""
        check_key(key, group)
        with self._lock:
            self._check_open()
            return (key, group) in self._index

    def length(self, key: bytes, group: int) -> int | None:
        """The object's payload length from the index, or None."""
        check_key(key, group)
        with self._lock:
            self._check_open()
            entry = self._index.get((key, group))
            return None if entry is None else entry.length

    def remove(self, key: bytes, group: int) -> bool:
        """Drop the object from the index and unlink its file."""
        check_key(key, group)
        okey = (key, group)
        with self._key_lock(okey):
            with self._lock:
                self._check_open()
                entry = self._index.pop(okey, None)
                if entry is None:
                    return False
                self._bytes -= entry.length
            _unlink_quietly(self._path(key, group))
        return True

    def clear(self, ns: bytes | None = None) -> int:
        """Drop every object of namespace `ns`, or every object when `ns` is None."""
        if ns is not None:
            check_ns(ns)
        with self._lock:
            self._check_open()
            dropped = [okey for okey, e in self._index.items() if ns is None or e.ns == ns]
            for okey in dropped:
                self._bytes -= self._index.pop(okey).length
        self._unlink_dropped(dropped)
        return len(dropped)

    def touch(self, key: bytes, group: int) -> None:
        """Move the object to the most-recently-used end, in memory and in its file's mtime."""
        check_key(key, group)
        with self._lock:
            self._check_open()
            if (key, group) not in self._index:
                return
            self._index.move_to_end((key, group))
            stamp = self._next_stamp()
        self._stamp_path(self._path(key, group), stamp)

    def stats(self) -> dict[str, int]:
        """A snapshot of the gauges and counters (also after close)."""
        with self._lock:
            return {"objects": len(self._index), "bytes": self._bytes,
                    "capacity_bytes": self.capacity_bytes, **self._counters}

    def close(self) -> None:
        """Release the directory lock; the files stay for the next FilesystemL2 to index."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._room.notify_all()  # waiting puts wake up and raise L2Error
        os.close(self._lock_fd)

    # ---- directory, index rebuild ----

    def _open_directory(self) -> int:
        """Create (0700) or check the directory and take its lock; returns the lock's fd."""
        d = self.directory
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            raise L2Error(f"L2 path {d} exists and is not a directory") from None
        except OSError as e:
            raise L2Error(f"cannot create L2 directory {d}: {e.strerror}") from e
        if not d.is_dir():
            raise L2Error(f"L2 path {d} is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise L2Error(f"L2 directory {d} is not writable")
        try:
            fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise L2Error(f"cannot create lock file in L2 directory {d}: {e.strerror}") from e
        try:
            # Two stores on one directory would delete each other's temp files and double-count
            # capacity. flock dies with the process, so a SIGKILLed owner never blocks a restart.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise L2Error(f"L2 directory {d} is in use by another FilesystemL2 "
                          f"(lock {d / LOCK_NAME} held)") from None
        try:
            for i in range(256):
                (d / f"{i:02x}").mkdir(mode=0o700, exist_ok=True)
            if self.fsync:
                self._fsync_dir(d)
        except OSError as e:
            os.close(fd)
            raise L2Error(f"cannot create subdirectories of L2 directory {d}: {e}") from e
        return fd

    def _rebuild(self) -> None:
        """Index every valid object file from its header; remove temp files and bad files."""
        found: list[tuple[int, str, ObjectKey, _Entry]] = []
        for i in range(256):
            sub = os.path.join(self.directory, f"{i:02x}")
            with os.scandir(sub) as it:
                for de in it:
                    if de.name.startswith(TMP_PREFIX):
                        # A put killed before its rename: its object was never acknowledged.
                        _unlink_quietly(de.path)
                        self._counters["tmp_removed"] += 1
                        continue
                    m = _OBJ_NAME.fullmatch(de.name)
                    if m is None or not de.is_file(follow_symlinks=False):
                        log.warning("L2: ignoring %s, not an object file", de.path)
                        continue
                    key, group = bytes.fromhex(m[1]), int(m[2])
                    try:
                        hdr, mtime = self._check_file(de.path, sub, key, group)
                    except (BadObject, OSError) as e:
                        log.warning("L2: removing bad object file %s: %s", de.path, e)
                        _unlink_quietly(de.path)
                        self._counters["corrupt_removed"] += 1
                        continue
                    found.append((mtime, de.name, (key, group), _Entry(hdr.ns, hdr.payload_len, 0)))
        found.sort(key=lambda f: (f[0], f[1]))
        for mtime, _, okey, entry in found:
            entry.gen = next(self._gens)
            self._index[okey] = entry
            self._bytes += entry.length
            self._last_stamp = max(self._last_stamp, mtime)
        # The capacity may have shrunk since the files were written.
        for okey in self._evict_until_fits(0):
            _unlink_quietly(self._path(*okey))
        log.info("L2: indexed %d objects (%d bytes) in %s; removed %d bad and %d temp files",
                 len(self._index), self._bytes, self.directory, self._counters["corrupt_removed"],
                 self._counters["tmp_removed"])

    def _check_file(self, path: str, sub: str, key: bytes, group: int) -> tuple[ObjectHeader, int]:
        """Check that a file's name, header and size agree; returns its header and mtime (ns)."""
        name = os.path.basename(path)
        if name != _object_name(key, group) or os.path.basename(sub) != key.hex()[:2]:
            raise BadObject(f"name is not canonical for its key/group or subdirectory {sub}")
        with open(path, "rb", buffering=0) as f:
            hdr = ObjectHeader.unpack(f.read(HEADER_BYTES))
            st = os.fstat(f.fileno())
        if hdr.key != key or hdr.group != group:
            raise BadObject(f"named for {key.hex()}-{group} but its header is for "
                             f"{hdr.key.hex()}-{hdr.group}")
        if st.st_size != HEADER_BYTES + hdr.payload_len:
            raise BadObject(f"file is {st.st_size} bytes, header says {HEADER_BYTES} + {hdr.payload_len}")
        return hdr, st.st_mtime_ns

    # ---- internals ----

    def _path(self, key: bytes, group: int) -> str:
        hexkey = key.hex()
        return os.path.join(self.directory, hexkey[:2], f"{hexkey}-{group}.obj")

    def _key_lock(self, okey: ObjectKey) -> threading.Lock:
        return self._key_locks[hash(okey) % _KEY_LOCK_STRIPES]

    def _check_open(self) -> None:
        if self._closed:
            raise L2Error(f"{self!r} is closed")

    def _next_stamp(self) -> int:
        """A strictly increasing wall-clock stamp (ns) for file mtimes; call under self._lock."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + _STAMP_STEP_NS)
        return self._last_stamp

    def _release(self, okey: ObjectKey, size: int) -> None:
        """Under self._lock: end a put's reservation and wake the puts waiting on it."""
        self._reserved -= size
        self._writing.discard(okey)
        self._room.notify_all()

    def _evict_until_fits(self, size: int) -> list[ObjectKey]:
        """Under self._lock: drop LRU objects from the index until `size` more bytes fit."""
        victims: list[ObjectKey] = []
        while self._index and self._bytes + self._reserved + size > self.capacity_bytes:
            okey, entry = self._index.popitem(last=False)
            self._bytes -= entry.length
            self._counters["evictions"] += 1
            victims.append(okey)
        return victims

    def _unlink_dropped(self, dropped: list[ObjectKey]) -> None:
        """Unlink files of objects already dropped from the index, unless a put re-created one since."""
        for okey in dropped:
            with self._key_lock(okey):
                with self._lock:
                    if okey in self._index:
                        continue
                _unlink_quietly(self._path(*okey))

    def _drop_bad(self, okey: ObjectKey, gen: int, path: str, reason: str) -> None:
        """Remove a file that failed a read check, if it is still the one the index points to."""
        with self._key_lock(okey):
            with self._lock:
                entry = self._index.get(okey)
                if entry is None or entry.gen != gen:
                    return  # evicted, removed or replaced while we read: not ours to judge
                del self._index[okey]
                self._bytes -= entry.length
                self._counters["corrupt_removed"] += 1
            _unlink_quietly(path)
        log.warning("L2: removed bad object file %s: %s", path, reason)

    def _write_temp(self, path: str, header: bytes, payload: memoryview, stamp: int) -> str:
        """Write header + payload to a new temp file beside `path`; returns the temp file's path."""
        tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
                os.utime(fd, ns=(stamp, stamp))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def _read_verified(self, path: str, key: bytes, group: int, out: memoryview, stamp: int) -> None:
        """Fill `out` with the object's payload; raises BadObject or OSError when it cannot be trusted."""
        with open(path, "rb", buffering=0) as f:
            hdr = ObjectHeader.unpack(f.read(HEADER_BYTES))
            if hdr.key != key or hdr.group != group:
                raise BadObject(f"header is for {hdr.key.hex()}-{hdr.group}")
            if hdr.payload_len != out.nbytes:
                raise BadObject(f"header says {hdr.payload_len} payload bytes, index says {out.nbytes}")
            size = os.fstat(f.fileno()).st_size
            if size != HEADER_BYTES + hdr.payload_len:
                raise BadObject(f"file is {size} bytes, header says {HEADER_BYTES} + {hdr.payload_len}")
            pos = 0
            while pos < out.nbytes:
                n = f.readinto(out[pos:])
                if not n:
                    raise BadObject(f"file ends at {HEADER_BYTES + pos} of {size} bytes")
                pos += n
            if zlib.crc32(out) != hdr.payload_crc:
                raise BadObject("payload checksum mismatch")
            try:
                os.utime(f.fileno(), ns=(stamp, stamp))  # the LRU position, for the next restart
            except OSError as e:
                log.debug("L2: cannot stamp %s: %s", path, e)

    def _stamp_path(self, path: str, stamp: int) -> None:
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError as e:  # evicted or removed meanwhile: its LRU position no longer matters
            log.debug("L2: cannot stamp %s: %s", path, e)

    def _fsync_dir(self, directory: str | Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unlink_quietly(path: str) -> None:
    """Unlink a file that may already be gone (evicted twice, removed by a concurrent clear)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("L2: cannot remove %s: %s", path, e)
