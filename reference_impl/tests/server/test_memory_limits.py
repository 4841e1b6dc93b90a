"""An L1 larger than the memory the server may use (issue 35, item 8): refused at start in one line naming the
mount's free space, the RAM and the memory cgroup's room, before a byte is taken. Tested in a real memory cgroup
made for the test (needs root and a writable cgroup fs, v1 or v2), with a `hybridkv serve` process in it."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridkv.engine.client import CacheClient
from hybridkv.memory.arena import shm_free_bytes
from hybridkv.memory.memory_room import GIB, MIB, check_room, margin, meminfo, memory_cgroup_dirs
from hybridkv.wire import protocol as P


class MemoryCgroup:
    """A memory cgroup of our own (v1 or v2), removed at the end; processes started with `preexec` run in it."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    def limit(self, n: int) -> None:
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(n))

    def peak(self) -> int | None:
        """The most it held (v2 kernels before 5.19 do not say)."""
        f = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else None

    def preexec(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))


def _make_cgroup(parent: Path, v2: bool) -> MemoryCgroup | None:
    path = parent / f"hkv-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError:
        return None
    if not (path / ("memory.max" if v2 else "memory.limit_in_bytes")).exists():  # no memory controller here
        path.rmdir()
        return None
    return MemoryCgroup(path, v2)


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    """Under this process's own memory cgroup (its limits apply too), or at its hierarchy's root (cgroup v2 lets
    a cgroup with processes have no child with controllers)."""
    made = None
    for leaf, top, v2 in memory_cgroup_dirs():
        for parent in (leaf, top):
            if v2 and parent == top and "memory" not in (top / "cgroup.subtree_control").read_text().split():
                try:
                    (top / "cgroup.subtree_control").write_text("+memory")
                except OSError:
                    continue
            made = _make_cgroup(parent, v2)
            if made:
                break
        if made:
            break
    if made is None:
        found = ", ".join(f"{top} (v{2 if v2 else 1})" for _, top, v2 in memory_cgroup_dirs()) or "none mounted"
        pytest.skip(f"no writable memory cgroup to make one in (needs root; cgroup hierarchies: {found})")
    yield made
    for _ in range(50):  # a process just reaped may still be counted a moment
        try:
            made.path.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    made.path.rmdir()


@pytest.fixture
def l1_dir() -> Iterator[Path]:
    """A directory of our own in /dev/shm, to see every file a server leaves there."""
    d = Path("/dev/shm") / f"hkv-test-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(sock_dir: str, l1_dir: Path, l1_gib: float, preexec=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", f"--endpoint=ipc://{sock_dir}/m.sock",
                             f"--l1-gib={l1_gib}", f"--l1-dir={l1_dir}", "--exit-with-parent"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)


def test_an_l1_over_the_memory_cgroup_limit_is_refused_in_one_line_before_a_byte(cgroup, l1_dir, sock_dir):
    """In a container limited to 600 MiB, `serve --l1-gib 1` passed the /dev/shm check, was killed by the OOM
    killer while backing its arena (exit 137, not a word) and left a 1 GiB `.creating` file behind."""
    if shm_free_bytes(l1_dir) < 2 * GIB or meminfo()["MemAvailable"] < 3 * GIB:
        pytest.skip("needs 2 GiB free in /dev/shm and 3 GiB of RAM available, so that the cgroup is what refuses")
    cgroup.limit(256 * MIB)
    p = serve(sock_dir, l1_dir, 1.0, cgroup.preexec)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 2, (p.returncode, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert "L1 of 1.00 GiB cannot be held" in line and "--l1-gib" in line, line
    assert f"{l1_dir} has " in line and "MemAvailable" in line, line  # the mount's and the RAM's figures
    assert f"limit 0.25 GiB of {cgroup.path}" in line, line  # and the cgroup's, the one that binds
    assert list(l1_dir.iterdir()) == []
    peak = cgroup.peak()
    assert peak is None or peak < 200 * MIB, f"the cgroup held {peak / MIB:.0f} MiB: the arena was backed"


def test_an_l1_within_the_memory_cgroup_limit_serves(cgroup, l1_dir, sock_dir):
    cgroup.limit(512 * MIB)
    p = serve(sock_dir, l1_dir, 0.0625, cgroup.preexec)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline() if ready else ""
        assert "ready" in line, (line, p.poll())
        with CacheClient(f"ipc://{sock_dir}/m.sock", timeout_s=10) as c:
            assert c.call(P.Health())[0].status == "ok"
        peak = cgroup.peak()
        assert peak is None or peak >= 64 * MIB  # the arena is charged to the cgroup: the check is about it
    finally:
        p.terminate()
        p.communicate(timeout=30)
    assert p.returncode == 0
    assert list(l1_dir.iterdir()) == []


def test_a_start_sweeps_the_creating_file_of_a_server_killed_while_backing_its_arena(server_factory, l1_dir):
    """A server killed in posix_fallocate (the OOM killer) leaves `.hybridkv-<pid>-<hex>.creating`, locked by
    no one: the next server in that directory removes it, as it removes dead servers' arenas; one still being
    created by a live process stays."""
    dead = subprocess.run([sys.executable, "-c", f"""
import fcntl, os
fd = os.open('{l1_dir}/.hybridkv-%d-0123abcd.creating' % os.getpid(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.posix_fallocate(fd, 0, 1 << 20)
os._exit(137)
"""], check=False)
    assert dead.returncode == 137
    (left,) = l1_dir.iterdir()
    live = l1_dir / f".hybridkv-{os.getpid()}-89abcdef.creating"
    fd = os.open(live, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        s = server_factory("--l1-dir", str(l1_dir))
        assert not left.exists()
        assert sorted(p.name for p in l1_dir.iterdir()) == sorted([live.name, Path(s.arena_path).name])
    finally:
        os.close(fd)


def test_an_l1_over_the_ram_available_is_refused_naming_it():
    """The RAM figure, on this machine's /proc/meminfo: MemAvailable less its margin (the check itself allocates
    nothing, so no server needs to try a size the machine cannot hold)."""
    info = meminfo()
    line = check_room(info["MemAvailable"], "/dev/shm", shm_free=1 << 60)
    assert line is not None and "L1 of " in line and "--l1-gib" in line, line
    ram = float(line.split("RAM ")[1].split(" GiB")[0]) * GIB
    assert abs(ram - (info["MemAvailable"] - margin(info["MemTotal"]))) < 256 * MIB, line  # it moves meanwhile
