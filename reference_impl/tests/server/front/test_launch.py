"""Starting a server, on real `hybridkv serve` processes: a live endpoint is refused and a stale one taken
over, the arena is backed at start (or refused in one line when its tmpfs cannot hold it), settings and
endpoints that cannot work are one-line errors, and a default start names its trust boundary."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hybridkv.engine.client import CacheClient
from hybridkv.model.presets import preset_layout
from hybridkv.server.front.launch import ServerStartError
from hybridkv.wire import protocol as P
from serverkit import Engine, alive, small_tmpfs


def test_a_live_endpoint_is_refused_and_a_stale_one_taken_over(server, server_factory, sock_dir):
    with pytest.raises(ServerStartError, match="in use by a live process"):
        server_factory(name=Path(server.endpoint).stem)
    assert alive(server.endpoint)
    stale = Path(sock_dir) / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))  # a socket file nobody listens on: what a killed server leaves
    s.close()
    srv = server_factory(name="stale")
    assert alive(srv.endpoint)


def test_a_default_server_names_its_trust_boundary():
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--admin" in out and "every client" in out
    assert preset_layout("tiny-hybrid")  # the docs' example layout still exists


MIB = 1 << 20


@pytest.fixture
def arena_tmpfs(tmp_path):
    """A 16 MiB tmpfs of our own, for the arena, to fill up for real (needs the right to mount)."""
    with small_tmpfs(tmp_path, "16m") as mnt:
        yield mnt


def fill(path: Path) -> int:
    """Write into `path` until its file system is full; the bytes written."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    block, n = b"\xff" * MIB, 0
    try:
        while True:
            try:
                n += os.write(fd, block[:MIB if n % MIB == 0 else MIB - n % MIB])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 4096:
                    return n
                block = block[:4096]
    finally:
        os.close(fd)


def test_arena_is_backed_at_start_so_a_tmpfs_filled_later_cannot_sigbus_the_server(server_factory, arena_tmpfs):
    """A sparse arena (ftruncate only) gets its pages on first touch; once another process filled the mount,
    the server's first copy into an unbacked page was SIGBUS. Backed at start, the filler gets ENOSPC."""
    s = server_factory("--l1-dir", str(arena_tmpfs), l1_gib=8 / 1024)
    st = os.stat(s.arena_path)
    assert st.st_blocks * 512 >= st.st_size, f"arena of {st.st_size} B has {st.st_blocks * 512} B allocated"
    assert fill(arena_tmpfs / "filler") <= 16 * MIB - st.st_size
    with CacheClient(s.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        n_chunks = 8 * MIB // sum(eng.sizes) - 1  # the slots' 8 MiB (the file holds the fence words too)
        keys = eng.keys(n_chunks, seed=3)
        for i in range(0, n_chunks, 16):  # the server copies raw frames into every slot of the arena
            part = keys[i:i + 16]
            prep, _ = c.call(P.PrepareStore(engine=eng.id, request="r", keys=part,
                                            objects=[(k, g) for k in range(len(part)) for g in range(len(eng.sizes))]))
            frames = [eng.payload(part[o.chunk], o.group, o.length).tobytes() for o in prep.slots]
            c.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), frames)
        res = eng.lookup(keys, policy="all")
        assert res.hit_chunks == n_chunks
        rep, got = c.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw"))
        for o, frame in zip(rep.objects, got, strict=True):
            assert np.array_equal(np.frombuffer(frame, np.uint8), eng.payload(keys[o.chunk], o.group, o.length))
    assert s.alive() and alive(s.endpoint)


def test_an_arena_the_tmpfs_cannot_hold_is_refused_at_start_in_one_line(server_factory, arena_tmpfs):
    fill(arena_tmpfs / "filler")
    os.truncate(arena_tmpfs / "filler", 12 * MIB)  # 4 MiB left
    with pytest.raises(ServerStartError) as ei:
        server_factory("--l1-dir", str(arena_tmpfs), l1_gib=8 / 1024)
    assert "--l1-gib" in str(ei.value) and "Traceback" not in str(ei.value)
    assert sorted(p.name for p in arena_tmpfs.iterdir()) == ["filler"]


@pytest.mark.parametrize("flags, named", [
    (["--l1-gib", "inf"], "--l1-gib"),
    (["--l2-gib", "inf", "--l2-dir", "{tmp}/l2"], "--l2-gib"),
    (["--l2-adapter", '{"type":"fs","base_path":"{tmp}/l2","max_capacity_gb":1e400}'], "max_capacity_gb"),
    (["--l2-adapter", "[" * 30000 + "]" * 30000], "nests too deeply"),
    (["--client-timeout", "nan"], "--client-timeout"),
    (["--client-timeout", "inf"], "--client-timeout"),
    (["--client-timeout", "1e-300"], "--client-timeout"),
    (["--quarantine", "nan"], "--quarantine"),
])
def test_impossible_serve_settings_are_one_line_errors(sock_dir, tmp_path, flags, named):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", f"ipc://{sock_dir}/x.sock",
                        "--l1-gib", "0.01", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("how, name", [("flag", "a\nb.sock"), ("flag", "a\x1b[2Jb.sock"), ("variable", "a\tb.sock")])
def test_an_endpoint_with_control_characters_is_a_one_line_error(sock_dir, how, name):
    """A newline or an escape sequence in the socket path would reach log lines and the filesystem as it is."""
    endpoint = f"ipc://{sock_dir}/{name}"
    args = ["--endpoint", endpoint] if how == "flag" else []
    env = {"HYBRIDKV_ENDPOINT": endpoint} if how == "variable" else {}
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--l1-gib", "0.01", *args],
                       capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "control characters" in r.stderr, r.stderr[-2000:]
