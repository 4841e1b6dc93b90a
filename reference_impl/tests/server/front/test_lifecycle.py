"""A server's life and end, on real `hybridkv serve` processes: every exit removes the arena and a start removes
the arenas of killed servers; SIGTERM while a store waits for L1 space or while a request is in progress, a
parent that exits, a shutdown with a spill backlog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.wire import protocol as P
from serverkit import Engine, alive


def _serve(endpoint: str, l1_dir: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", endpoint, "--l1-gib",
                             "0.01", "--l1-dir", l1_dir, "--log-level", "warning", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _wait_ready(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "ready" in line, (line, p.stderr.read() if p.stderr else "")
    return line.split("arena=")[1].split()[0]


def test_sigterm_at_any_moment_removes_the_arena(sock_dir):
    l1_dir = tempfile.mkdtemp(prefix="hkv-l1-", dir="/dev/shm")
    try:
        # moments of the start (imports, the arena, the bind), then a ready server (None: once it said so)
        for delay in (0.0, 0.05, 0.2, 0.5, None):
            p = _serve(f"ipc://{sock_dir}/t.sock", l1_dir)
            if delay is None:
                _wait_ready(p)
            else:
                time.sleep(delay)
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
            assert p.returncode in (0, 143, -signal.SIGTERM), (delay, p.returncode)
            assert list(Path(l1_dir).iterdir()) == [], f"arena left after SIGTERM at {delay}s"
    finally:
        for f in Path(l1_dir).iterdir():
            f.unlink()
        os.rmdir(l1_dir)


def test_sigterm_while_a_store_waits_for_l1_space(server_factory, tmp_path):
    srv = server_factory("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1", "--io-threads", "1",
                         "--spill-watermark", "0", l1_gib=2 / 1024)
    c = CacheClient(srv.endpoint, timeout_s=30)
    eng = Engine(c)
    futs = [c.submit(P.PrepareStore(engine=eng.id, request=str(i), keys=eng.keys(1, seed=200 + i),
                                    objects=[(0, g) for g in range(4)])) for i in range(60)]
    time.sleep(0.05)
    assert srv.stop(signal.SIGTERM) == 0
    assert not Path(srv.arena_path).exists()
    c.close()
    del futs


def test_a_start_removes_arenas_of_killed_servers_and_keeps_live_ones(sock_dir):
    l1_dir = tempfile.mkdtemp(prefix="hkv-l1-", dir="/dev/shm")
    procs = []
    try:
        killed = _serve(f"ipc://{sock_dir}/k.sock", l1_dir)
        procs.append(killed)
        dead_arena = _wait_ready(killed)
        killed.kill()
        killed.wait()
        assert Path(dead_arena).exists()  # kill -9 cannot clean up
        live = _serve(f"ipc://{sock_dir}/l.sock", l1_dir)
        procs.append(live)
        live_arena = _wait_ready(live)
        third = _serve(f"ipc://{sock_dir}/m.sock", l1_dir)
        procs.append(third)
        _wait_ready(third)
        assert not Path(dead_arena).exists() and Path(live_arena).exists()
        assert alive(f"ipc://{sock_dir}/l.sock")
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        for f in Path(l1_dir).iterdir():
            f.unlink()
        os.rmdir(l1_dir)


def test_a_server_whose_parent_exits_stops_without_a_traceback(sock_dir, tmp_path):
    """--exit-with-parent: the parent (and with it the read end of stdout) is gone before the last line."""
    err = tmp_path / "server.err"
    starter = (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'hybridkv.cli', 'serve', '--endpoint', 'ipc://{sock_dir}/p.sock',"
        f" '--l1-gib', '0.01', '--exit-with-parent'], stdout=subprocess.PIPE, stderr=open({str(err)!r}, 'w'))\n"
        "line = p.stdout.readline().decode()\n"
        "print(p.pid, line.split('arena=')[1].split()[0], flush=True)\n"
        "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=60).stdout.split()
    pid, arena = int(out[0]), out[1]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the server outlived its parent"
    assert not Path(arena).exists()
    text = err.read_text()
    assert "Traceback" not in text and "BrokenPipe" not in text, text


def test_a_shutdown_with_a_spill_backlog_neither_recurses_nor_reports_failed_writes(server_factory, tmp_path):
    """Each spill finishing at shutdown started the next, which the closed pool refused, which counted as a
    failed write and started the next: one nested call per batch and an 'L2 writes failed' line."""
    l2 = tmp_path / "l2"
    s = server_factory("--l2-dir", str(l2), "--l2-gib", "1", "--l2-fsync", "--io-threads", "1",
                       "--spill-watermark", "0.95", l1_gib=0.05)
    with CacheClient(s.endpoint, timeout_s=60) as c:
        eng = Engine(c)
        # The engine says it is alive while it writes its payload, as a real one does: on a loaded machine the write
        # between its prepare and its commit outlasted --client-timeout and the server reclaimed it.
        c.keepalive(eng.id, eng.reg.heartbeat_s)
        # 512 keys, 2,048 synced objects: 32 spill batches, each of which started the next at the old shutdown
        keys = eng.keys(512, seed=7)
        eng.store(keys)  # one reservation: its commit makes every object dirty at once, the backlog in one request
        # Stopped at once, the server shows its backlog: what L2 holds while it cannot run is what spilled so far.
        # (Looking at its Stats instead raced the one I/O thread, which on a loaded machine drained the backlog
        # of a store in pieces before the stop came.)
        os.kill(s.pid, signal.SIGSTOP)
        try:
            spilled = sum(1 for _ in l2.glob("*/*.obj"))
            assert spilled < len(keys) * len(eng.sizes), spilled  # still spilling when it is told to stop
            s.proc.send_signal(signal.SIGTERM)
        finally:
            os.kill(s.pid, signal.SIGCONT)
        assert s.stop() == 0
    err = s.proc.stderr.read() if s.proc.stderr else ""
    assert "L2 writes failed" not in err and "Recursion" not in err and "Traceback" not in err, err[-3000:]


def test_sigterm_answers_a_request_in_progress_with_shutting_down(server_factory):
    """A request still in progress at SIGTERM was never answered: its client waited out its whole timeout."""
    s = server_factory(l1_gib=1.0)
    groups = (GroupLayout(kind="attention", layer_names=("a",), page_bytes=4096, block_tokens=16),) + tuple(
        GroupLayout(kind="recurrent", layer_names=(f"r{i}",), page_bytes=4096, block_tokens=16) for i in range(3))
    n = 50_000
    with CacheClient(s.endpoint, timeout_s=20) as c:
        reg = c.call(P.Register(layout=ModelLayout(model="m", groups=groups), chunk_tokens=16))[0]
        keys = chunk_keys(reg.namespace, np.arange(n * 16), 16)
        fut = c.submit(P.PrepareStore(engine=reg.engine, request="r", keys=keys,
                                      objects=[(k, g) for k in range(n) for g in range(4)]))
        time.sleep(0.1)  # it has arrived and works in turns
        t = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(ServerError) as ei:
            fut.result(timeout=30)
        assert ei.value.code == P.ErrorCode.SHUTTING_DOWN, ei.value
        assert time.monotonic() - t < 5
    assert s.proc.wait(timeout=10) == 0
