"""Hostile clients and host faults against real server processes: one test (or more) per finding of issue 23."""

from __future__ import annotations

import errno
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.keys import chunk_keys
from hybridkv.layout import MAX_LAYERS, MAX_NAME_CHARS, GroupLayout, ModelLayout
from hybridkv.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import ServerStartError, start_server
from serverkit import Engine, RawDealer, alive, process_cpu_s, process_fds, small_tmpfs

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


# ---- 1. a full L1 tmpfs -----------------------------------------------------------------------------

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


# ---- 2. file descriptors ----------------------------------------------------------------------------

def hold_connections(path: str, n: int) -> list[socket.socket]:
    """n bare unix-socket connections to an ipc endpoint that never speak (each costs the server one fd)."""
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:  # refused while the server is at its cap: what an attacker sees
            s.close()
            continue
        held.append(s)
    return held


@pytest.mark.parametrize("soft_only", [True, False])
def test_more_connections_than_the_fd_limit_leave_the_server_serving(sock_dir, soft_only):
    """libzmq aborts on EMFILE on an ipc endpoint (and spins on tcp). The server raises its soft limit to the
    hard one at start, and past its cap on clients stops accepting until connections close."""
    endpoint = f"ipc://{sock_dir}/fd.sock"
    if soft_only:  # the common default: a soft limit far below the hard one
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        old = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        try:
            s = start_server(ServerConfig(endpoint=endpoint, l1_bytes=int(0.02 * GIB), admin=True))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, old)
    else:
        s = start_server(ServerConfig(endpoint=endpoint, l1_bytes=int(0.02 * GIB), admin=True), nofile=256)
    try:
        with CacheClient(endpoint, timeout_s=10) as early:
            assert early.call(P.Health())[0].status == "ok"
            held = hold_connections(endpoint[len("ipc://"):], 400)
            try:
                time.sleep(0.5)
                assert s.alive(), s.proc.stderr.read() if s.proc.stderr else ""
                assert early.call(P.Health())[0].status == "ok"  # a connected client keeps being served
            finally:
                for h in held:
                    h.close()
            with CacheClient(endpoint, timeout_s=10) as late:  # and new ones get in once others left
                assert late.call(P.Health(), timeout=10)[0].status == "ok"
        assert s.alive()
    finally:
        s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_connections_past_the_cap_are_refused_without_spinning(sock_dir):
    """A tcp endpoint had no cap: libzmq accepted until the open-file limit, then spun on EMFILE at 100% of a
    core while the connections stayed, and no new engine got in. Now the door closes at --max-clients (the
    kernel drops new SYNs), the server idles, connected clients are served, and new ones get in once others
    left."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    port = int(endpoint.rsplit(":", 1)[1])
    s = start_server(ServerConfig(endpoint=endpoint, l1_bytes=int(0.02 * GIB), max_clients=64), nofile=256)
    held: list[socket.socket] = []
    try:
        with CacheClient(endpoint, timeout_s=10) as early:
            assert early.call(P.Health())[0].status == "ok"
            for i in range(400):  # more than the server's open-file limit, in bursts of 16
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                held.append(c)
                if i % 16 == 15:
                    time.sleep(0.02)
            for c in held:  # a byte each: a handshake the server's full queue dropped is retried with it
                try:
                    c.send(b"\xff")
                except OSError:
                    pass
            # until its files settle, past the clients' first SYN retries (1 s and 3 s after theirs were dropped)
            last, stable_since, until = -1, time.monotonic(), time.monotonic() + 20
            while time.monotonic() < until and time.monotonic() - stable_since < 4.5:
                n = process_fds(s.pid)
                if n != last:
                    last, stable_since = n, time.monotonic()
                time.sleep(0.1)
            cpu0, t0 = process_cpu_s(s.pid), time.monotonic()
            time.sleep(3)
            busy = (process_cpu_s(s.pid) - cpu0) / (time.monotonic() - t0)
            assert busy < 0.15, f"the server used {busy:.0%} of a core while at its cap"
            assert last < 256 - 16, f"{last} files open under a limit of 256 ({busy:.0%} CPU)"
            with pytest.raises(OSError):  # a new connection is not taken (its SYNs dropped)
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            assert early.call(P.Health())[0].status == "ok"  # a connected client keeps being served
        for h in held:
            h.close()
        held.clear()
        t0 = time.monotonic()
        with CacheClient(endpoint, timeout_s=10) as late:  # and new ones get in once others left
            assert late.call(P.Health(), timeout=10)[0].status == "ok"
        assert time.monotonic() - t0 < 5
        assert s.alive()
    finally:
        for h in held:
            h.close()
        s.close()


# ---- 4. what a lease, a reservation and an engine make the server keep -------------------------------

def expect_refused(c: CacheClient, msg: P.Message, field: str) -> None:
    with pytest.raises(ServerError) as ei:
        c.call(msg)
    assert ei.value.code == P.ErrorCode.BAD_MESSAGE and field in ei.value.message, ei.value


def test_ids_names_and_layouts_past_their_bounds_are_refused(server_factory):
    s = server_factory()
    tiny = preset_layout("tiny-hybrid")
    long = "x" * (MAX_NAME_CHARS + 1)
    with CacheClient(s.endpoint, timeout_s=10) as c:
        for msg, field in [
            (P.Register(layout=tiny, chunk_tokens=0, name=long), "$.name"),
            (P.Register(layout=tiny, chunk_tokens=0, salt=long), "$.salt"),
            (P.Register(layout=msgspec.structs.replace(tiny, model=long), chunk_tokens=0), "$.layout.model"),
            (P.Register(layout=msgspec.structs.replace(tiny, groups=(msgspec.structs.replace(
                tiny.groups[0], layer_names=(long,)),) + tiny.groups[1:]), chunk_tokens=0), "layer_names"),
        ]:
            expect_refused(c, msg, field)
    raw = RawDealer(s.endpoint)  # a layout our own client would not even build
    try:
        reg = msgspec.to_builtins(P.Register(layout=tiny, chunk_tokens=0))
        reg["layout"]["groups"][0]["layer_names"] = [f"l{i}" for i in range(MAX_LAYERS + 1)]
        reply = raw.request(reg)
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_MESSAGE, reply
        assert "layer_names" in reply.message, reply
    finally:
        raw.close()
    with CacheClient(s.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        keys = eng.keys(2, seed=4)
        eng.store(keys)
        expect_refused(c, P.Lookup(engine=eng.id, request=long, keys=keys), "$.request")
        expect_refused(c, P.PrepareStore(engine=eng.id, request=long, keys=keys, objects=[(0, 0)]), "$.request")
        expect_refused(c, P.EndSession(engine=eng.id, request=long), "$.request")
        ok = "r" * MAX_NAME_CHARS  # the bound itself is taken
        res = eng.lookup(keys, request=ok)
        assert res.hit_chunks == 2
        c.call(P.EndSession(engine=eng.id, request=ok))
        assert c.call(P.Stats())[0].counters["leases"] == 0


# ---- 6. one client against limits all share ----------------------------------------------------------

def test_one_connection_takes_only_its_share_of_the_engines(server_factory):
    s = server_factory("--max-engines", "8", "--max-engines-per-client", "3")
    with CacheClient(s.endpoint, timeout_s=10) as a, CacheClient(s.endpoint, timeout_s=10) as b:
        mine = [Engine(a) for _ in range(3)]
        with pytest.raises(ServerError) as ei:
            Engine(a)
        assert ei.value.code == P.ErrorCode.LIMIT and "--max-engines-per-client 3" in ei.value.message
        Engine(b)  # another client still registers
        a.call(P.Unregister(engine=mine[0].id))
        Engine(a)  # and an unregistered engine gives its place back


# ---- 8. one-line errors ------------------------------------------------------------------------------

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


# ---- 7. shutdown with a spill backlog ----------------------------------------------------------------

def test_a_shutdown_with_a_spill_backlog_neither_recurses_nor_reports_failed_writes(server_factory, tmp_path):
    """Each spill finishing at shutdown started the next, which the closed pool refused, which counted as a
    failed write and started the next: one nested call per batch and an 'L2 writes failed' line."""
    s = server_factory("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "1", "--l2-fsync", "--io-threads", "1",
                       "--spill-watermark", "0.95", l1_gib=0.2)
    with CacheClient(s.endpoint, timeout_s=30) as c:
        eng = Engine(c)
        keys = eng.keys(int(0.15 * (1 << 30)) // sum(eng.sizes), seed=7)
        for i in range(0, len(keys), 256):
            eng.store(keys[i:i + 256])
        backlog = c.call(P.Stats())[0].counters
    assert backlog["l2_spills"] < len(keys)  # still spilling when it is told to stop
    assert s.stop() == 0
    err = s.proc.stderr.read() if s.proc.stderr else ""
    assert "L2 writes failed" not in err and "Recursion" not in err and "Traceback" not in err, err[-3000:]


def test_a_huge_prepare_lets_other_clients_through_while_it_works(server_factory):
    """A 200,000-object PrepareStore took the loop for its whole length (0.5 to 2 s here), so a request another
    client sent just after it was answered after it. Now it works in 5 ms turns, and the other is answered first."""
    s = server_factory(l1_gib=1.0)
    groups = (GroupLayout(kind="attention", layer_names=("a",), page_bytes=4096, block_tokens=16),) + tuple(
        GroupLayout(kind="recurrent", layer_names=(f"r{i}",), page_bytes=4096, block_tokens=16) for i in range(3))
    n = 50_000
    with CacheClient(s.endpoint, timeout_s=60) as big, CacheClient(s.endpoint, timeout_s=60) as other:
        reg = big.call(P.Register(layout=ModelLayout(model="m", groups=groups), chunk_tokens=16))[0]
        keys = chunk_keys(reg.namespace, np.arange(n * 16), 16)
        msg = P.PrepareStore(engine=reg.engine, request="r", keys=keys,
                             objects=[(c, g) for c in range(n) for g in range(4)])
        done: dict[str, float] = {}
        fut = big.submit(msg)
        fut.add_done_callback(lambda _: done.setdefault("prepare", time.monotonic()))
        time.sleep(0.05)  # the prepare has arrived and started
        t = time.monotonic()
        assert other.call(P.Health())[0].status == "ok"
        done["health"] = time.monotonic()
        prep = fut.result(timeout=60)[0]
        assert len(prep.slots) == 4 * n
        assert done["health"] < done["prepare"], "the other client waited for the whole prepare"
        print(f"Health answered in {1e3 * (done['health'] - t):.1f} ms during a prepare of {4 * n} objects "
              f"that took {done['prepare'] - t:.2f} s")


# ---- 9. SIGTERM while a request waits -----------------------------------------------------------------

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


def rss_anon(pid: int) -> int:
    """The server's private memory (its heap), not the arena pages it touched."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_one_client_holds_at_most_what_the_formula_in_protocol_md_says(server_factory):
    """docs/protocol.md: C x [0.35 MiB + L x (0.3 KiB + 150 B x min(K x G, N1)) + R x 0.3 KiB + F x K x 60 B]
    per connection (+ what requests being answered hold: none here). Two connections try to hold more, with
    fields at and past their bounds (1 MiB names and request ids were kept before: 1 MiB per lease), and
    the server's heap stays under twice the formula."""
    c_, leases, k = 2, 16, 128
    s = server_factory("--max-engines-per-client", str(c_), "--max-leases", str(leases), "--max-keys", str(k),
                       l1_gib=0.1)
    tiny = preset_layout("tiny-hybrid")
    g = len(tiny.groups)
    with CacheClient(s.endpoint, timeout_s=30) as first, CacheClient(s.endpoint, timeout_s=30) as second:
        warm = Engine(second)
        warm.store(warm.keys(k, seed=9))
        second.call(P.Unregister(engine=warm.id))
        before = rss_anon(s.pid)
        for name in ("n" * (1 << 20), "n" * MAX_NAME_CHARS, "m" * MAX_NAME_CHARS, "o" * MAX_NAME_CHARS):
            try:  # the first connection registers engines with the longest names it can
                first.call(P.Register(layout=tiny, chunk_tokens=0, name=name))
            except ServerError:
                pass  # too long, or its share is taken
        eng = Engine(second)
        keys = eng.keys(k, seed=9)
        for i in range(leases + 4):  # the second holds every lease it can, each pinning every object
            for rid in (f"{i}" + "r" * (1 << 20), f"{i}" + "r" * (MAX_NAME_CHARS - 3)):
                try:
                    eng.lookup(keys, policy="all", request=rid)
                except ServerError:
                    pass
        counters = first.call(P.Stats())[0].counters
        assert counters["engines"] == 3 and counters["leases"] == leases
        grown = rss_anon(s.pid) - before
    n1 = k * g
    bound = 2 * c_ * (0.35 * MIB + leases * (300 + 150 * min(k * g, n1)) + 1024 * 300 + 16 * k * 60)
    assert grown <= bound, f"the server's heap grew {grown / MIB:.2f} MiB; the formula says {bound / MIB:.2f} MiB"
