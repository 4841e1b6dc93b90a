"""Filesystem L2: one file per object, written to a temp name and renamed, checked on every read.

An object file is a 4 KiB header block (the 64-byte ObjectHeader, then zeros) and the payload, so the payload
moves with O_DIRECT (`fs_record`). Every syscall goes through directory fds without following symlinks
(`fs_dir.ObjectDir`, which has the directory's layout). This module is the adapter: the index (object ->
namespace, length, LRU position) lives in memory and is rebuilt on start from the headers alone; payload
checksums are verified on every read instead, because checksumming tens of GB at start would delay the server by
minutes. Capacity counts what the files occupy on disk: header block plus payload, rounded up to the file
system's block.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from hybridkv.model.keys import ObjectKey
from hybridkv.server.l2.base import L2Adapter, L2Error, byte_view, check_key, check_ns
from hybridkv.server.l2.fs_dir import ObjectDir
from hybridkv.server.l2.header import BadObject
from hybridkv.server.machinery.lru import Indexed, LruIndex

log = logging.getLogger(__name__)

_KEY_LOCK_STRIPES = 64
# LRU stamps are file mtimes; successive stamps differ by at least 1 us so that file systems which
# keep microseconds (not nanoseconds) still order them after a restart.
_STAMP_STEP_NS = 1000
_COUNTERS = ("puts", "gets", "hits", "misses", "corrupt_removed", "evictions", "bytes_written",
             "bytes_read", "tmp_removed", "write_errors", "syncs", "direct_bytes_written", "direct_bytes_read")
# Read errors that condemn the file itself (media or file-system damage), not this process's state.
_BAD_FILE_ERRNOS = frozenset({errno.EIO, errno.ENODATA, errno.EUCLEAN, errno.EBADMSG, errno.ELOOP})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class _IndexEntry(Indexed):  # oid, size: the payload's length (the index's `bytes`: the payload bytes held)
    ns: bytes
    gen: int  # changes on every commit, so a reader can tell "my file" from "a newer file"


class FilesystemL2(L2Adapter):
    """L2 on a local directory: one checksummed file per object, LRU-evicted to `capacity_bytes` on disk.

    `capacity_bytes` bounds the disk space the object files take (block-rounded, header blocks
    included). With `fsync=True` a put returns only once its file and rename are durable; concurrent
    puts share one syncfs (group commit), so small objects do not pay one disk flush each.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, fsync: bool = False,
                 direct_io: bool = True) -> None:
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
        # least recently used first; in pieces (one OrderedDict of every object resizes in one long step)
        self._index: LruIndex[_IndexEntry] = LruIndex()
        self._disk = 0       # disk bytes held (what capacity bounds)
        self._reserved = 0   # disk bytes of puts in flight, counted against capacity before they land
        self._gens = itertools.count(1)
        self._last_stamp = 0
        self._closed = False
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._dir = ObjectDir(self.directory, direct=direct_io)
        try:
            self._rebuild()
        except BaseException:
            self._dir.close()
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
        need = self._dir.disk_bytes(size)
        if need > self.capacity_bytes:
            raise L2Error(f"object {key.hex()}-{group} of {size} bytes ({need} on disk) exceeds L2 capacity "
                          f"{self.capacity_bytes} bytes")
        okey = (key, group)
        name = ObjectDir.name(key, group)
        victims: list[ObjectKey] = []
        with self._room:
            while True:
                self._check_open()
                entry = self._index.get(okey)
                if entry is not None and entry.ns != ns:
                    raise L2Error(f"object {key.hex()}-{group} is held under another namespace: not replaced")
                if entry is not None and entry.size == size:
                    # Keys hash the token prefix, so the same key means the same bytes: skip the write.
                    self._index.touch(entry)
                    self._counters["puts"] += 1
                    stamp = self._next_stamp()
                    held = True
                    break
                held = False
                if okey in self._writing:
                    self._room.wait()  # one write per object: wait for it, then it is a no-op
                    continue
                victims += self._evict_until_fits(need)
                if self._disk + self._reserved + need <= self.capacity_bytes:
                    self._reserved += need
                    self._writing.add(okey)
                    stamp = self._next_stamp()
                    break
                # Only puts in flight hold the room; once they land they can be evicted.
                self._room.wait()
        self._unlink_dropped(victims)
        if held:
            self._stamp(key, name, stamp)
            return
        committed = False
        try:
            try:
                tmp, direct = self._dir.write_temp(key, group, ns, view, stamp)
            except OSError as e:
                raise self._write_error(f"cannot write L2 object {self._dir.path(key, group)}", e) from e
            with self._key_lock(okey):
                try:
                    self._dir.rename(key, tmp, name)
                except OSError as e:
                    self._dir.unlink(key, tmp)
                    raise self._write_error(f"cannot rename {tmp} to {self._dir.path(key, group)}", e) from e
                with self._room:
                    old = self._index.put(_IndexEntry(okey, size, ns, next(self._gens)))
                    if old is not None:
                        self._disk -= self._dir.disk_bytes(old.size)
                    self._disk += need
                    self._counters["puts"] += 1
                    self._counters["bytes_written"] += size
                    self._counters["direct_bytes_written"] += direct
                    self._release(okey, need)
                    committed = True
        finally:
            if not committed:
                with self._room:
                    self._release(okey, need)
        if self.fsync:
            try:
                self._dir.sync()
            except OSError as e:
                raise self._write_error(f"wrote {self._dir.path(key, group)} but cannot sync it", e) from e
            with self._lock:
                self._counters["syncs"] += 1

    def get_into(self, key: bytes, group: int, out: memoryview, ns: bytes | None = None) -> bool:
        """Read header and payload straight into `out`, then check header (and namespace), size and crc32."""
        check_key(key, group)
        out = byte_view(out, writable=True)
        okey = (key, group)
        with self._lock:
            self._check_open()
            entry = self._index.get(okey)
            if entry is not None and out.nbytes != entry.size:
                raise ValueError(f"out is {out.nbytes} bytes but object {key.hex()}-{group} is "
                                 f"{entry.size} bytes")
            self._counters["gets"] += 1
            if entry is None or (ns is not None and entry.ns != ns):
                self._counters["misses"] += 1
                return False
            self._index.touch(entry)
            gen = entry.gen
            stamp = self._next_stamp()
        try:
            direct = self._read(key, group, out, stamp, ns)
        except FileNotFoundError:
            reason = "file missing"
        except OSError as e:
            if e.errno not in _BAD_FILE_ERRNOS:
                # Out of file descriptors or memory says nothing about the file: a miss, kept.
                log.warning("L2: cannot read %s: %s", self._dir.path(key, group), e)
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
                self._counters["direct_bytes_read"] += direct
            return True
        self._drop_bad(okey, gen, reason)
        with self._lock:
            self._counters["misses"] += 1
        return False

    def length(self, key: bytes, group: int, ns: bytes | None = None) -> int | None:
        """The object's payload length from the index, or None (also when it is of another namespace than `ns`)."""
        check_key(key, group)
        with self._lock:
            self._check_open()
            entry = self._index.get((key, group))
            return None if entry is None or (ns is not None and entry.ns != ns) else entry.size

    def remove(self, key: bytes, group: int) -> bool:
        """Drop the object from the index and unlink its file."""
        check_key(key, group)
        okey = (key, group)
        with self._key_lock(okey):
            with self._lock:
                self._check_open()
                entry = self._index.pop(okey)
                if entry is None:
                    return False
                self._forget(entry)
            self._unlink(key, ObjectDir.name(key, group))
        return True

    def clear_walk(self, namespaces: frozenset[bytes] | None) -> Iterator[dict[bytes, int]]:
        """The index's table a shard snapshot at a time (under the lock, one C call), in pieces of table.PIECE: the
        objects of `namespaces` that the index still holds (the same entry) popped under the lock, then unlinked
        outside it."""
        pieces = self._index.table.pieces()
        while True:
            dropped: list[ObjectKey] = []
            counts: dict[bytes, int] = {}
            with self._lock:  # the next piece (a shard's snapshot when the walk reaches it) taken under the lock too
                self._check_open()
                if (piece := next(pieces, None)) is None:
                    return
                for e in piece:
                    if (namespaces is None or e.ns in namespaces) and self._index.get(e.oid) is e:
                        self._index.pop(e.oid)
                        self._forget(e)
                        dropped.append(e.oid)
                        counts[e.ns] = counts.get(e.ns, 0) + 1
            self._unlink_dropped(dropped)
            yield counts

    def touch(self, key: bytes, group: int) -> None:
        """Move the object to the most-recently-used end, in memory and in its file's mtime."""
        check_key(key, group)
        with self._lock:
            self._check_open()
            entry = self._index.get((key, group))
            if entry is None:
                return
            self._index.touch(entry)
            stamp = self._next_stamp()
        self._stamp(key, ObjectDir.name(key, group), stamp)

    def stats(self) -> dict[str, int]:
        """A snapshot of the gauges and counters (also after close)."""
        with self._lock:
            return {"objects": len(self._index), "bytes": self._index.bytes, "disk_bytes": self._disk,
                    "capacity_bytes": self.capacity_bytes, "syncfs_calls": self._dir.sync_calls, **self._counters}

    def close(self) -> None:
        """Release the directory lock; the files stay for the next FilesystemL2 to index."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._room.notify_all()  # waiting puts wake up and raise L2Error
        self._dir.close()

    # ---- index rebuild ----

    def _rebuild(self) -> None:
        """Index every valid object file from its header (`ObjectDir.survey` removes temp files and bad files)."""
        survey = self._dir.survey(self.capacity_bytes)
        self._counters["tmp_removed"] += survey.tmp_removed
        self._counters["corrupt_removed"] += survey.bad_removed
        for f in survey.found:
            entry = _IndexEntry((f.key, f.group), f.payload_len, f.ns, next(self._gens))
            self._index.put(entry)
            self._disk += self._dir.disk_bytes(entry.size)
            self._last_stamp = max(self._last_stamp, f.mtime)
        # The capacity may have shrunk since the files were written.
        for key, group in self._evict_until_fits(0):
            self._unlink(key, ObjectDir.name(key, group))
        log.info("L2: indexed %d objects (%d bytes, %d on disk) in %s; removed %d bad and %d temp files",
                 len(self._index), self._index.bytes, self._disk, self.directory,
                 self._counters["corrupt_removed"], self._counters["tmp_removed"])

    # ---- internals ----

    def _write_error(self, what: str, e: OSError) -> L2Error:
        """Count a failed write and say why; a full disk says how full."""
        with self._lock:
            self._counters["write_errors"] += 1
        if e.errno in _FULL_ERRNOS:
            try:
                free = f"{self._dir.free_bytes()} B free"
            except OSError:
                free = "free space unknown"
            return L2Error(f"{what}: L2 disk full ({errno.errorcode.get(e.errno or 0, e.errno)}, {free}; "
                           f"L2 holds {self._disk} of {self.capacity_bytes} B): the object is not in L2")
        return L2Error(f"{what}: {e}")

    def _key_lock(self, okey: ObjectKey) -> threading.Lock:
        return self._key_locks[hash(okey) % _KEY_LOCK_STRIPES]

    def _check_open(self) -> None:
        if self._closed:
            raise L2Error(f"{self!r} is closed")

    def _next_stamp(self) -> int:
        """A strictly increasing wall-clock stamp (ns) for file mtimes; call under self._lock."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + _STAMP_STEP_NS)
        return self._last_stamp

    def _forget(self, entry: _IndexEntry) -> None:
        """Under self._lock: take a dropped entry out of the disk bytes held (the index counts the payload's)."""
        self._disk -= self._dir.disk_bytes(entry.size)

    def _release(self, okey: ObjectKey, need: int) -> None:
        """Under self._lock: end a put's reservation and wake the puts waiting on it."""
        self._reserved -= need
        self._writing.discard(okey)
        self._room.notify_all()

    def _evict_until_fits(self, need: int) -> list[ObjectKey]:
        """Under self._lock: drop LRU objects from the index until `need` more disk bytes fit."""
        victims: list[ObjectKey] = []
        while self._index and self._disk + self._reserved + need > self.capacity_bytes:
            entry = self._index.pop_oldest()
            self._forget(entry)
            self._counters["evictions"] += 1
            victims.append(entry.oid)
        return victims

    def _unlink_dropped(self, dropped: list[ObjectKey]) -> None:
        """Unlink files of objects already dropped from the index, unless a put re-created one since."""
        for okey in dropped:
            with self._key_lock(okey):
                with self._lock:
                    if okey in self._index:
                        continue
                self._unlink(okey[0], ObjectDir.name(*okey))

    def _drop_bad(self, okey: ObjectKey, gen: int, reason: str) -> None:
        """Remove a file that failed a read check, if it is still the one the index points to."""
        with self._key_lock(okey):
            with self._lock:
                entry = self._index.get(okey)
                if entry is None or entry.gen != gen:
                    return  # evicted, removed or replaced while we read: not ours to judge
                self._index.pop(okey)
                self._forget(entry)
                self._counters["corrupt_removed"] += 1
            self._unlink(okey[0], ObjectDir.name(*okey))
        log.warning("L2: removed bad object file %s: %s", self._dir.path(*okey), reason)

    def _read(self, key: bytes, group: int, out: memoryview, stamp: int, ns: bytes | None) -> int:
        return self._dir.read_into(key, group, out, stamp, ns)

    def _unlink(self, key: bytes, name: str) -> None:
        try:
            self._dir.unlink(key, name)
        except OSError as e:
            log.warning("L2: cannot remove %s/%s: %s", self.directory, name, e)

    def _stamp(self, key: bytes, name: str, stamp: int) -> None:
        try:
            self._dir.stamp(key, name, stamp)
        except OSError as e:  # evicted or removed meanwhile: its LRU position no longer matters
            log.debug("L2: cannot stamp %s: %s", name, e)
