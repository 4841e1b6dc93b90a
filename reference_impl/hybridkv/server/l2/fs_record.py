"""An object file of the filesystem L2, on its own: its format, how one is written, and how one is read and checked.

A file is a DATA_OFFSET-byte header block (the 64-byte `header.ObjectHeader`, then zeros) and the payload, so the
payload moves with O_DIRECT when the file system takes it (the arena's slots are page-aligned): a spill or a reload
costs one DMA and no page-cache copy; the unaligned tail and the header go through the page cache. The header is
written last, holding the payload's crc32, which every read checks before a byte is served (L2.md has the format).
Everything here works on an open fd or a name inside a directory fd: which directory is `fs_dir`'s business.
"""

from __future__ import annotations

import errno
import os
import stat
from concurrent.futures import Executor, Future

import numpy as np

from hybridkv.server.l2.header import BadObject, ObjectHeader, crc32

DATA_OFFSET = 4096   # payload offset in a file: the header block, so the payload is O_DIRECT-aligned
_ALIGN = 4096        # O_DIRECT buffer, offset and length alignment (the largest logical block in use)
_PIECE = 16 << 20   # bytes per read syscall, so the checksum of one piece overlaps the read of the next
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)
HAS_O_DIRECT = bool(_O_DIRECT)


def disk_bytes(payload: int, block: int) -> int:
    """What an object of `payload` bytes occupies on disk: its header block and payload, rounded up to `block`."""
    return DATA_OFFSET + -(-payload // block) * block


def write_record(fd: int, key: bytes, group: int, ns: bytes, payload: memoryview, stamp: int, direct: bool,
                 crc_pool: Executor) -> int:
    """Write a whole object file into the empty file `fd`: payload, then its header, then `stamp` as its mtime.
    Returns how many payload bytes went with O_DIRECT.

    The payload's crc32 is computed on a `crc_pool` thread while the payload is on its way to the disk (the checksum
    and the writes both release the GIL), and the header holding it is written last."""
    crc = crc_pool.submit(crc32, payload, 0)
    try:
        direct_bytes = _write_payload(fd, payload, direct)
    finally:
        payload_crc = crc.result()
    header = ObjectHeader(ns, key, group, payload.nbytes, payload_crc)
    _pwrite_all(fd, header.pack(DATA_OFFSET), 0)
    os.utime(fd, ns=(stamp, stamp))
    return direct_bytes


def _write_payload(fd: int, payload: memoryview, direct: bool) -> int:
    """Write the payload at DATA_OFFSET: O_DIRECT for its aligned part when the file system takes it.
    Returns the bytes written with O_DIRECT."""
    n = payload.nbytes
    bulk = n - n % _ALIGN if direct and _address(payload) % _ALIGN == 0 else 0
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


def read_record(fd: int, key: bytes, group: int, out: memoryview, stamp: int, ns: bytes | None, direct: bool,
                crc_pool: Executor) -> int:
    """Fill `out` with the payload of the object file `fd`; raises BadObject or OSError when it cannot be trusted (or
    its header names another namespace than `ns`). Stamps its mtime (the LRU position, for the next restart).
    Returns the payload bytes read with O_DIRECT."""
    raw = os.pread(fd, DATA_OFFSET, 0)
    hdr = ObjectHeader.unpack(raw, DATA_OFFSET)
    hdr.check_for(key, group, out.nbytes, ns)
    size = os.fstat(fd).st_size
    if size != DATA_OFFSET + hdr.payload_len:
        raise BadObject(f"file is {size} bytes, header says {DATA_OFFSET} + {hdr.payload_len}")
    crc, direct_bytes = _read_payload(fd, out, direct, crc_pool)
    if crc != hdr.payload_crc:
        raise BadObject("payload checksum mismatch")
    try:
        os.utime(fd, ns=(stamp, stamp))  # the LRU position, for the next restart
    except OSError:
        pass
    return direct_bytes


def _read_payload(fd: int, out: memoryview, direct: bool, crc_pool: Executor) -> tuple[int, int]:
    """Read the payload into `out` piece by piece; the crc32 of each piece runs on a helper thread
    while the next is read, so a reload costs about max(read, checksum), not their sum.
    Returns (crc32, bytes read with O_DIRECT)."""
    n = out.nbytes
    bulk = n - n % _ALIGN if direct and _address(out) % _ALIGN == 0 else 0
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
            crc = crc_pool.submit(_crc_after, crc, piece)
            pos = end
    finally:
        if dfd >= 0:
            os.close(dfd)
        value = crc.result() if crc is not None else 0
    return value, bulk


def header_of(fd: int) -> tuple[ObjectHeader, int, int]:
    """(header, file size, mtime ns) of the object file `fd`; BadObject for a header that cannot be trusted."""
    st = os.fstat(fd)
    return ObjectHeader.unpack(os.pread(fd, DATA_OFFSET, 0), DATA_OFFSET), st.st_size, st.st_mtime_ns


def check_header(hdr: ObjectHeader, size: int, key: bytes, group: int) -> None:
    """BadObject unless the header of a file of `size` bytes is that of object (key, group), whole."""
    if hdr.key != key or hdr.group != group:
        raise BadObject(f"named for {key.hex()}-{group} but its header is for {hdr.key.hex()}-{hdr.group}")
    if size != DATA_OFFSET + hdr.payload_len:
        raise BadObject(f"file is {size} bytes, header says {DATA_OFFSET} + {hdr.payload_len}")


def open_record(name: str, dir_fd: int) -> int:
    """A read-only fd on object file `name`, BadObject when it is not a regular file: opened non-blocking and
    checked before any read, as a FIFO in an object's place would block the thread (its L2 reads, shutdown)."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadObject("not a regular file")
    os.set_blocking(fd, True)
    return fd


def _crc_after(prev: Future[int] | None, piece: memoryview) -> int:
    """crc32 of `piece` continuing the crc of everything before it (chained futures keep the order)."""
    return crc32(piece, prev.result() if prev is not None else 0)


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
