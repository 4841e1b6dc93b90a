"""FilesystemL2 against a hostile or full directory (issue 9, items 5, 6, 10), on real files.

Symlinks planted in the directory never send a write, a read or an unlink outside it; a full disk is
an L2Error that says so; capacity bounds the disk space the files really take; fsync puts share syncs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.fs import FilesystemL2
from hybridkv.server.l2.fs_record import DATA_OFFSET
from hybridkv.server.l2.header import ObjectHeader
from serverkit import small_tmpfs

NS = b"namespace-a-0001"
MB = 1 << 20


def key_with_first_byte(b: int, i: int = 0) -> bytes:
    return bytes([b]) + i.to_bytes(15, "little")


def test_symlinked_subdirectory_is_refused_at_start(tmp_path):
    """A fan-out subdirectory that is a symlink is refused by name; nothing outside is touched."""
    l2_dir, outside = tmp_path / "l2", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.obj").write_bytes(b"not yours")
    (outside / ".tmp-1-abc").write_bytes(b"not yours either")
    FilesystemL2(l2_dir, MB).close()
    (l2_dir / "ab").rmdir()
    (l2_dir / "ab").symlink_to(outside)
    with pytest.raises(L2Error, match=r"L2 subdirectory .*/ab is a symlink or not a directory: refusing"):
        FilesystemL2(l2_dir, MB)
    assert sorted(p.name for p in outside.iterdir()) == [".tmp-1-abc", "victim.obj"]


def test_subdirectory_swapped_for_a_symlink_while_open_gets_nothing(tmp_path):
    """The directory fds were opened at start: a later swap of a subdirectory for a symlink is not followed."""
    l2_dir, outside = tmp_path / "l2", tmp_path / "outside"
    outside.mkdir()
    with FilesystemL2(l2_dir, MB) as l2:
        (l2_dir / "ab").rename(tmp_path / "moved-ab")
        (l2_dir / "ab").symlink_to(outside)
        key = key_with_first_byte(0xAB)
        l2.put(key, 0, NS, b"x" * 5000)
        out = bytearray(5000)
        assert l2.get_into(key, 0, memoryview(out)) and out == b"x" * 5000
        assert l2.remove(key, 0)
    assert list(outside.iterdir()) == []


def test_symlinked_object_file_is_neither_followed_nor_served(tmp_path):
    """An object name that is a symlink to a file outside: not indexed, not read, replaced by a put."""
    l2_dir, outside = tmp_path / "l2", tmp_path / "outside.bin"
    key = key_with_first_byte(0x10)
    with FilesystemL2(l2_dir, MB) as l2:
        l2.put(key, 0, NS, b"y" * 3000)
    name = l2_dir / "10" / f"{key.hex()}-0.obj"
    outside.write_bytes(name.read_bytes())  # a valid object, outside
    name.unlink()
    name.symlink_to(outside)
    with FilesystemL2(l2_dir, MB) as l2:
        assert l2.length(key, 0) is None  # not indexed: a symlink is not an object file
        l2.put(key, 0, NS, b"z" * 3000)  # the rename replaces the link itself
        assert not name.is_symlink()
    assert outside.read_bytes()[DATA_OFFSET:] == b"y" * 3000


def test_object_file_swapped_for_a_fifo_while_open_is_a_miss_at_once(tmp_path):
    """A FIFO in place of an indexed object file (no writer): the read neither blocks nor serves; it is a
    miss in well under a second, so the I/O threads and the server's shutdown never hang on it."""
    l2_dir = tmp_path / "l2"
    key = key_with_first_byte(0x3C)
    with FilesystemL2(l2_dir, MB) as l2:
        l2.put(key, 0, NS, b"y" * 5000)
        (path,) = [p for p in (l2_dir / "3c").iterdir() if p.suffix == ".obj"]
        path.unlink()
        os.mkfifo(path)
        got: list[bool] = []
        reader = threading.Thread(target=lambda: got.append(l2.get_into(key, 0, memoryview(bytearray(5000)))),
                                  daemon=True)
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "the read blocked on the FIFO"
        assert got == [False]


def test_symlinked_lock_file_is_refused(tmp_path):
    l2_dir, outside = tmp_path / "l2", tmp_path / "elsewhere.lock"
    l2_dir.mkdir()
    (l2_dir / ".lock").symlink_to(outside)
    with pytest.raises(L2Error, match=r"lock file .*\.lock is a symlink: refusing to follow it"):
        FilesystemL2(l2_dir, MB)
    assert not outside.exists()


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs of our own, to fill up for real (needs the right to mount)."""
    with small_tmpfs(tmp_path, "2m") as mnt:
        yield mnt


def test_full_disk_is_an_l2_error_that_says_so(small_fs):
    """ENOSPC: the put raises L2Error naming the full disk, leaves no temp file, and L2 keeps working."""
    with FilesystemL2(small_fs / "l2", 64 * MB) as l2:
        l2.put(key_with_first_byte(1), 0, NS, b"a" * (MB // 2))
        with pytest.raises(L2Error, match=r"L2 disk full \(ENOSPC, \d+ B free; L2 holds \d+ of \d+ B\)"):
            l2.put(key_with_first_byte(2), 0, NS, b"b" * (3 * MB))
        assert not [p for p in (small_fs / "l2").glob("*/.tmp-*")]
        s = l2.stats()
        assert s["write_errors"] == 1 and s["objects"] == 1
        l2.put(key_with_first_byte(3), 0, NS, b"c" * 1000)  # the failed put's reservation was released
        out = bytearray(MB // 2)
        assert l2.get_into(key_with_first_byte(1), 0, memoryview(out)) and out == b"a" * (MB // 2)


def _du(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.glob("*/*.obj"))


def test_capacity_bounds_what_tiny_objects_take_on_disk(tmp_path):
    """2000 objects of 100 B under a 1 MiB capacity: the files take at most 1 MiB, as counted."""
    with FilesystemL2(tmp_path, MB) as l2:
        for i in range(2000):
            l2.put(key_with_first_byte(i % 256, i), 0, NS, bytes([i % 256]) * 100)
        s = l2.stats()
        used = _du(tmp_path)
        assert used <= s["disk_bytes"] <= MB
        assert s["objects"] == MB // (DATA_OFFSET + 4096) and s["bytes"] == 100 * s["objects"]
        assert s["evictions"] == 2000 - s["objects"]


def test_fsync_puts_from_many_threads_share_syncs(tmp_path):
    """Eight threads of tiny fsync puts: every put is durable on return, and syncfs runs fewer times."""
    errors: list[BaseException] = []
    with FilesystemL2(tmp_path, 64 * MB, fsync=True) as l2:
        def worker(t: int) -> None:
            try:
                for i in range(40):
                    l2.put(key_with_first_byte(t, i), 0, NS, bytes([t]) * 1000)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        s = l2.stats()
    assert errors == []
    assert s["objects"] == 320 and s["syncs"] == 320
    assert 1 <= s["syncfs_calls"] < 320, s["syncfs_calls"]


def test_unaligned_buffers_and_odd_sizes_round_trip(tmp_path):
    """O_DIRECT needs aligned memory: unaligned views and odd lengths take the buffered path, same bytes."""
    import mmap

    m = mmap.mmap(-1, 8 * MB)
    view = memoryview(m)
    data = os.urandom(3 * MB + 123)
    with FilesystemL2(tmp_path, 64 * MB) as l2:
        for off, n in ((0, 3 * MB), (0, 3 * MB + 123), (1, 3 * MB + 123), (4096, 5000)):
            key = key_with_first_byte(off % 256, n)
            view[off:off + n] = data[:n]
            l2.put(key, 0, NS, view[off:off + n])
            view[off:off + n] = bytes(n)
            assert l2.get_into(key, 0, view[off:off + n])
            assert view[off:off + n] == data[:n]


def test_object_files_of_groups_no_layout_has_are_not_indexed(tmp_path):
    """A layout has at most 64 groups, and each group an index holds is a table of its own: a directory planted
    with files of group 64 and past (or a group spelled with a leading zero) is not indexed, nor refused whole;
    the adapter takes no such group either."""
    l2_dir = tmp_path / "l2"
    key = key_with_first_byte(0x21)
    with FilesystemL2(l2_dir, MB) as l2:
        l2.put(key, 63, NS, b"g" * 3000)
        with pytest.raises(ValueError, match=r"group must be an int in \[0, 63\], got 64"):
            l2.put(key, 64, NS, b"g" * 3000)
    good = l2_dir / "21" / f"{key.hex()}-63.obj"
    for group in ("64", "99999", "4294967295", "063", "7" * 200):
        (good.parent / f"{key.hex()}-{group}.obj").write_bytes(good.read_bytes())
    with FilesystemL2(l2_dir, MB) as l2:
        assert l2.stats()["objects"] == 1 and l2.length(key, 63) == 3000
        with pytest.raises(ValueError):
            l2.length(key, 64)
    assert len(list(good.parent.iterdir())) == 6  # ignored, not removed: not the server's to judge


def test_a_planted_file_larger_than_the_l2_is_removed_and_evicts_nothing(tmp_path):
    """A file with a valid header claiming a payload larger than the capacity (sparse: a few blocks on disk), and
    the newest: put() refuses such an object, so the rebuild removes it as bad. Before, it was indexed at its
    claimed size, and fitting the capacity evicted every older object first, then it."""
    l2_dir = tmp_path / "l2"
    with FilesystemL2(l2_dir, 64 * MB) as l2:
        for i in range(10):
            l2.put(key_with_first_byte(1, i), 0, NS, bytes([i]) * 5000)
    huge = key_with_first_byte(2)
    planted = l2_dir / "02" / f"{huge.hex()}-0.obj"
    with open(planted, "wb") as f:
        f.write(ObjectHeader(NS, huge, 0, 128 * MB, 0).pack(DATA_OFFSET))
        f.truncate(DATA_OFFSET + 128 * MB)
    with FilesystemL2(l2_dir, 64 * MB) as l2:
        s = l2.stats()
        assert (s["objects"], s["evictions"], s["corrupt_removed"]) == (10, 0, 1), s
        for i in range(10):
            out = bytearray(5000)
            assert l2.get_into(key_with_first_byte(1, i), 0, memoryview(out)) and out == bytes([i]) * 5000
    assert not planted.exists()
