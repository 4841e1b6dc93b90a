"""`hybridkv serve` processes with the L2 flags: the seed's JSON and flags, refused ones, a symlinked L2 directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import rediskit
from hybridkv.engine.client import CacheClient
from hybridkv.server.front.launch import ServerStartError
from serverkit import Engine

TINY_L1 = 1 / 1024


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `hybridkv serve` to its exit (for flags that must stop it at the door)."""
    return subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("flag, says", [
    ("--device", "--device is a seed flag hybridkv does not take: the server holds no device memory"),
    ("--host", "--host is a seed flag hybridkv does not take: the server binds loopback or an ipc socket"),
    ("--remote-url", "--remote-url is a seed flag hybridkv does not take: use --l2-adapter"),
    ("--local-disk", "--local-disk is a seed flag hybridkv does not take: use --l2-dir"),
])
def test_seed_flags_we_do_not_take_stop_with_one_line(flag, says):
    r = serve(flag, "x")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and says in r.stderr


@pytest.mark.parametrize("args, says", [
    (["--l2-adapter", '{"type":"s3"}'], '"type" must be "fs", "redis" or "valkey"'),
    (["--l2-adapter", "{oops"], "--l2-adapter is not JSON"),
    (["--l2-adapter", '{"type":"fs","base_path":"/tmp/x","max_capacity_gb":1}', "--l2-dir", "/tmp/y"], "give one"),
    (["--eviction-policy", "random"], "invalid choice"),
])
def test_bad_l2_and_seed_values_are_refused(args, says):
    r = serve(*args)
    assert r.returncode == 2 and says in r.stderr


def test_seed_flags_that_match_ours_start_a_server(tmp_path):
    """--port, --l1-size-gb, --eviction-policy FIFO, --chunk-size and the fs JSON: a ready server that spills."""
    port = rediskit.free_port()
    l2 = tmp_path / "l2"
    spec = json.dumps({"type": "fs", "base_path": str(l2), "max_capacity_gb": 0.25})
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--port", str(port), "--l1-size-gb",
                             f"{TINY_L1:.6f}", "--eviction-policy", "FIFO", "--chunk-size", "0", "--l2-adapter",
                             spec, "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert f"endpoint=tcp://127.0.0.1:{port}" in line and f"l2={l2}" in line, line
        with CacheClient(f"tcp://127.0.0.1:{port}", timeout_s=20) as c:
            eng = Engine(c)
            for seed in range(3):  # 3 x 13 chunks x 4 groups of 20 KiB through a 1 MiB L1: spills
                eng.store(eng.keys(13, seed=seed))
        assert list(l2.glob("*/*.obj"))
    finally:
        proc.terminate()
        proc.wait(30)
    arena = line.split("arena=")[1].split()[0]
    assert not Path(arena).exists()


def test_symlinked_l2_subdirectory_stops_the_server_with_its_name(server_factory, tmp_path):
    """Issue 9 item 5 on a real server: a planted symlink is refused at start, nothing outside is touched."""
    l2, outside = tmp_path / "l2", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.obj").write_bytes(b"not the server's")
    l2.mkdir()
    (l2 / "7f").symlink_to(outside)
    with pytest.raises(ServerStartError, match=r"L2 subdirectory .*/7f is a symlink or not a directory"):
        server_factory("--l2-dir", str(l2), "--l2-gib", "0.1", l1_gib=TINY_L1)
    assert [p.name for p in outside.iterdir()] == ["keep.obj"]
