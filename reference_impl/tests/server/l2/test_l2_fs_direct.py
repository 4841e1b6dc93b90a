"""FilesystemL2's O_DIRECT path, its fallback, and the checksum, on real files and real file systems.

Payloads from page-aligned memory (arena slots) move with O_DIRECT for their 4 KiB-aligned part and
through the page cache for the tail; a file system that refuses O_DIRECT (ramfs; tmpfs before Linux
6.6) takes the page-cache path for everything with the same bytes. The payload checksum is CRC-32
through ISA-L when installed: it must equal zlib.crc32, and damage at the edges of the direct part
(the last direct block, the buffered tail, a torn 4 KiB block) must be caught on read.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import subprocess
import uuid
import zlib
from pathlib import Path

import pytest
from hybridkv.server.l2 import header as l2mod
from hybridkv.server.l2.fs import FilesystemL2
from hybridkv.server.l2.fs_record import DATA_OFFSET

NS = b"namespace-d-0004"
PAGE = 4096
MB = 1 << 20
# sizes around the 4 KiB O_DIRECT granule: less than a block, exact blocks, a block and a byte, ...
SIZES = [1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE - 1, 3 * MB, 3 * MB + 123, 17 * MB + 4095]


def key(i: int) -> bytes:
    return bytes([i % 256]) + i.to_bytes(15, "little")


def takes_o_direct(d: Path) -> bool:
    p = d / f".od-{uuid.uuid4().hex[:6]}"
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        p.unlink(missing_ok=True)


class Slots:
    """Page-aligned memory, as the arena's slots are (mmap is page-aligned)."""

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, -(-size // PAGE) * PAGE + PAGE)
        self.view = memoryview(self.mem)

    def close(self) -> None:
        self.view.release()
        self.mem.close()


def round_trip(l2: FilesystemL2, sizes: list[int], offset: int = 0) -> None:
    """Put each size from page-aligned memory (+offset), read it back into zeroed memory, compare."""
    for i, n in enumerate(sizes):
        data = os.urandom(n)
        s = Slots(n + offset)
        try:
            s.view[offset:offset + n] = data
            l2.put(key(i), 0, NS, s.view[offset:offset + n])
            s.view[:] = bytes(len(s.view))
            assert l2.get_into(key(i), 0, s.view[offset:offset + n]), n
            assert s.view[offset:offset + n] == data, n
            assert s.view[:offset] == bytes(offset) and s.view[offset + n:] == bytes(len(s.view) - offset - n)
        finally:
            s.close()


def aligned_part(sizes: list[int]) -> int:
    return sum(n - n % PAGE for n in sizes)


def test_aligned_slots_move_with_o_direct_and_odd_sizes_round_trip(tmp_path):
    if not takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    with FilesystemL2(tmp_path, 256 * MB) as l2:
        round_trip(l2, SIZES)
        s = l2.stats()
        for n in SIZES:  # the file is the header block plus exactly the payload: no padding left behind
            assert l2.length(key(SIZES.index(n)), 0) == n
        assert s["direct_bytes_written"] == s["direct_bytes_read"] == aligned_part(SIZES) > 0
        assert s["bytes_written"] == s["bytes_read"] == sum(SIZES)
    sizes = sorted(f.stat().st_size for f in tmp_path.glob("*/*.obj"))
    assert sizes == sorted(DATA_OFFSET + n for n in SIZES)


def test_unaligned_memory_takes_the_page_cache_path_with_the_same_bytes(tmp_path):
    with FilesystemL2(tmp_path, 256 * MB) as l2:
        round_trip(l2, SIZES, offset=8)  # 8 bytes past a page: O_DIRECT would refuse this buffer
        s = l2.stats()
        assert s["direct_bytes_written"] == s["direct_bytes_read"] == 0 and s["bytes_read"] == sum(SIZES)


def test_direct_io_off_takes_the_page_cache_path(tmp_path):
    with FilesystemL2(tmp_path, 256 * MB, direct_io=False) as l2:
        round_trip(l2, SIZES)
        assert l2.stats()["direct_bytes_written"] == 0


def _mount(tmp_path: Path, fstype: str) -> Path:
    mnt = tmp_path / f"{fstype}-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", fstype, "-o", "mode=0700", fstype, str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a {fstype} (needs root): {r.stderr.strip()}")
    return mnt


@pytest.mark.parametrize("fstype", ["ramfs", "tmpfs"])
def test_file_systems_with_and_without_o_direct_give_the_same_bytes(tmp_path, fstype):
    """ramfs refuses O_DIRECT (EINVAL), as tmpfs did before Linux 6.6: every byte takes the page cache."""
    mnt = _mount(tmp_path, fstype)
    try:
        direct = takes_o_direct(mnt)
        if fstype == "ramfs":
            assert not direct  # the refusing file system this test relies on
        with FilesystemL2(mnt / "l2", 256 * MB) as l2:
            round_trip(l2, SIZES)
            s = l2.stats()
            assert s["direct_bytes_written"] == s["direct_bytes_read"] == (aligned_part(SIZES) if direct else 0)
            assert s["hits"] == len(SIZES) and s["corrupt_removed"] == 0
        with FilesystemL2(mnt / "l2", 256 * MB) as l2:  # and a restart indexes every file written either way
            assert l2.stats()["objects"] == len(SIZES)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---- the checksum ----

def test_crc32_is_zlibs_crc32_whatever_computes_it():
    data = os.urandom(3 * MB + 77)
    view = memoryview(data)
    for lo, hi in ((0, 0), (0, 1), (5, 4101), (4096, 3 * MB), (0, len(data))):
        assert l2mod.crc32(view[lo:hi], 0) == zlib.crc32(view[lo:hi])
    assert l2mod.crc32(view[MB:], l2mod.crc32(view[:MB], 0)) == zlib.crc32(data)  # chained pieces
    assert l2mod.CRC32_IMPL in ("isal", "zlib")


def _flip(p: Path, at: int) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def _zero_block(p: Path, at: int) -> None:
    """A torn write: one 4 KiB block of the payload never reached the disk (reads back as zeros)."""
    with open(p, "r+b") as f:
        f.seek(at - at % PAGE)
        f.write(bytes(PAGE))


N = 3 * MB + 123  # direct part 3 MiB + 0, buffered tail 123 bytes
DAMAGE = {
    "first_payload_byte": lambda p: _flip(p, DATA_OFFSET),
    "last_direct_byte": lambda p: _flip(p, DATA_OFFSET + N - N % PAGE - 1),
    "first_tail_byte": lambda p: _flip(p, DATA_OFFSET + N - N % PAGE),
    "last_byte": lambda p: _flip(p, DATA_OFFSET + N - 1),
    "torn_block": lambda p: _zero_block(p, DATA_OFFSET + MB + 5),
    "crc_field": lambda p: _flip(p, 56),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=str)
def test_damage_at_the_edges_of_the_direct_part_is_a_miss_and_removed(tmp_path, damage):
    s = Slots(N)
    try:
        data = os.urandom(N)
        s.view[:N] = data
        with FilesystemL2(tmp_path, 64 * MB) as l2:
            l2.put(key(1), 0, NS, s.view[:N])
            l2.put(key(2), 0, NS, s.view[:N])
            path = next(tmp_path.glob(f"*/{key(1).hex()}-0.obj"))
            DAMAGE[damage](path)
            assert not l2.get_into(key(1), 0, s.view[:N])
            assert not path.exists() and not l2.contains(key(1), 0)
            s.view[:N] = bytes(N)
            assert l2.get_into(key(2), 0, s.view[:N]) and s.view[:N] == data  # the neighbour still reads
            assert l2.stats()["corrupt_removed"] == 1
    finally:
        s.close()


def test_an_l2_larger_than_its_disk_is_warned_of_at_start(tmp_path: Path, caplog):
    """A capacity the disk cannot hold serves on (failed writes are counted, their objects stay in L1), but the
    operator hears of it when the server starts, not when the disk fills."""
    from hybridkv.server.l2.fs_spec import FsL2Spec
    from hybridkv.server.l2.specs import GIB

    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.WARNING, logger="hybridkv.server.l2.specs"):
        FsL2Spec(str(tmp_path / "small"), 64 * MB).open().close()
        assert not caplog.records
        FsL2Spec(str(tmp_path / "huge"), free + 64 * GIB).open().close()
    (warning,) = caplog.records
    assert "L2: capacity" in warning.getMessage() and "ENOSPC" in warning.getMessage()
    assert str(tmp_path / "huge") in warning.getMessage()
