"""The spill watch of `hybridkv l2bench`: inotify on a real directory tree counts objects renamed in."""

from __future__ import annotations

import os
import time

from hybridkv_bench.l2.watch import DirWatch


def wait_until_seen(w: DirWatch, n: int) -> None:
    deadline = time.monotonic() + 10  # generous: a loaded host may be slow to run the watcher thread
    while w.seen < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_dir_watch_counts_objects_renamed_in_once_each_and_ignores_the_rest(tmp_path):
    for sub in ("00", "ab"):
        (tmp_path / sub).mkdir()
    (tmp_path / "00" / "a-0.obj").write_bytes(b"x")  # there before the watch: counted by its scan
    w = DirWatch(tmp_path, want=3)
    t0 = time.perf_counter()
    for sub, name in (("ab", "b-0.obj"), ("ab", "b-0.obj"), ("00", "c-1.notobj")):
        tmp = tmp_path / sub / ".tmp-1"
        tmp.write_bytes(b"y")
        os.rename(tmp, tmp_path / sub / name)   # b-0.obj twice (a replacing put): one object
    wait_until_seen(w, 2)
    time.sleep(0.2)  # a double count would show now
    assert w.seen == 2 and w.at is None
    (tmp_path / "ab" / ".tmp-2").write_bytes(b"z")
    os.rename(tmp_path / "ab" / ".tmp-2", tmp_path / "ab" / "d-0.obj")
    wait_until_seen(w, 3)
    took = w.done_at(t0)
    assert w.seen == 3 and took is not None and 0 <= took <= time.perf_counter() - t0


def test_dir_watch_that_never_sees_enough_objects_says_none(tmp_path):
    (tmp_path / "00").mkdir()
    w = DirWatch(tmp_path, want=1)
    (tmp_path / "00" / "x.tmp").write_bytes(b"x")
    assert w.done_at(time.perf_counter()) is None and w.seen == 0
