"""The server's log lines: JSON lines with stable field names (--log-format json), and the headline line that
--headline-interval rate-limits. A real server process; its stderr is read after it stopped."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time

from hybridkv.engine.client import CacheClient
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.books.telemetry import HEADLINE_FIGURES
from hybridkv.server.front import launch
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from serverkit import Engine, counters


def test_json_lines_and_a_rate_limited_headline(sock_dir):
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/j.sock", l1_bytes=int(0.02 * GIB)),
                          log_level="info", log_format="json", headline_interval=0.5)
    try:
        with CacheClient(server.endpoint) as c:
            eng = Engine(c)
            keys = eng.keys(2, seed=1)
            eng.store(keys)
            c.call(P.Release(engine=eng.id, lease=eng.lookup(keys).lease))
            t0 = time.monotonic()
            time.sleep(2.1)
            elapsed = time.monotonic() - t0
        assert server.stop() == 0
        err = server.proc.stderr.read()
    finally:
        server.close()
    records = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    assert records
    for r in records:
        assert {"ts", "level", "logger", "msg"} <= r.keys(), r
        assert isinstance(r["ts"], float) and r["level"] in ("debug", "info", "warning", "error", "critical")
    heads = [r for r in records if r.get("event") == "headline"]
    # once per 0.5 s (the loop ticks every 0.5 s at most): never more often, and not skipped
    assert 2 <= len(heads) <= elapsed / 0.5 + 2, len(heads)
    assert all(list(h["fields"]) == list(HEADLINE_FIGURES) for h in heads)
    last = heads[-1]["fields"]
    assert last["lookups"] == 1 and last["hit_chunks"] == 2 and last["lookup_chunks"] == 2
    assert last["engines"] == 1 and last["bytes_committed"] == 2 * sum(eng.sizes)
    assert heads[-1]["logger"] == "hybridkv.server" and heads[-1]["msg"].startswith("headline: ")
    times = [h["ts"] for h in heads]
    assert all(b - a >= 0.45 for a, b in zip(times, times[1:], strict=False)), times


def test_headline_interval_is_checked(sock_dir):
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", f"ipc://{sock_dir}/h.sock",
                        "--l1-gib", "0.01", "--headline-interval", "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--headline-interval must be 0 (never) or more seconds, got -1" in r.stderr


def test_text_lines_carry_their_time_in_utc(sock_dir):
    """A text line's time says its zone (UTC, `Z`), whatever the machine's zone is: here UTC-10."""
    import datetime
    import os
    import re

    before = datetime.datetime.now(datetime.UTC)
    env = {**os.environ, "TZ": "HST10"}
    code = ("import logging, time; from hybridkv.server.front.logs import setup_logging; "
            "setup_logging('info', 'text'); logging.getLogger('hybridkv.server').info('ready')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    after = datetime.datetime.now(datetime.UTC)
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z INFO hybridkv.server: ready\n", r.stderr)
    assert m, r.stderr
    t = datetime.datetime.fromisoformat(m[1]).replace(tzinfo=datetime.UTC)
    assert before - datetime.timedelta(seconds=1) <= t <= after


def test_a_server_whose_log_nobody_reads_while_it_runs_keeps_serving(sock_dir):
    """start_server's default stderr was a pipe that nobody read until the server stopped: past 64 KiB of log the
    server's next line blocked its loop for good. A client can make it log that much (768 engines left silent
    until reclaimed, a warning each); the log is a file now, read afterwards as the pipe was."""
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/q.sock", l1_bytes=int(0.02 * GIB),
                                       client_timeout_s=1.0, admin=True))
    clients = [CacheClient(server.endpoint, timeout_s=10) for _ in range(12)]
    try:
        layout = preset_layout("tiny-hybrid")
        for c in clients:
            for _ in range(64):
                c.call(P.Register(layout=layout, chunk_tokens=0, name="silent-" + "x" * 100))
        with CacheClient(server.endpoint, timeout_s=10) as admin:
            deadline = time.monotonic() + 60
            while admin.call(P.Stats())[0].counters["engines_reclaimed"] < 12 * 64:
                assert time.monotonic() < deadline, "the engines were not reclaimed"
                time.sleep(0.1)
            assert admin.call(P.Health())[0].status == "ok"
    finally:
        for c in clients:
            c.close()
        rc = server.stop()
    assert rc == 0 and server.proc.stderr is not None
    assert server.proc.stderr.read().count("silent for") == 12 * 64


def test_a_servers_stderr_is_kept_to_its_head_and_tail_however_much_a_client_makes_it_log(sock_dir, monkeypatch):
    """start_server kept a server's whole stderr in an unlinked file: a client decides how much the server logs (a
    warning per engine it leaves silent until reclaimed), so the file grew on the starter's disk for as long as the
    server ran. The starter now drains a pipe into its first and last bytes (here 2 and 8 KiB), the middle counted."""
    monkeypatch.setattr(launch, "STDERR_HEAD_BYTES", 2048, raising=False)
    monkeypatch.setattr(launch, "STDERR_TAIL_BYTES", 8192, raising=False)
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/t.sock", l1_bytes=int(0.02 * GIB),
                                       client_timeout_s=0.5, admin=True))
    try:
        layout = preset_layout("tiny-hybrid")
        with CacheClient(server.endpoint, timeout_s=30) as c:
            for i in range(64):  # ~200 bytes of warning each: 12 KiB and more
                c.call(P.Register(layout=layout, chunk_tokens=0, name=f"silent-{i:02d}-" + "x" * 100))
            with CacheClient(server.endpoint, timeout_s=30) as admin:
                deadline = time.monotonic() + 60
                while counters(admin)["engines_reclaimed"] < 64:
                    assert time.monotonic() < deadline, "the engines were not reclaimed"
                    time.sleep(0.05)
            held = os.stat(f"/proc/{server.pid}/fd/2")
            assert not stat.S_ISREG(held.st_mode) or held.st_size <= 2048 + 8192, held
        assert server.stop() == 0
        assert server.proc.stderr is not None
        err = server.proc.stderr.read()
    finally:
        server.close()
    gap = re.search(r"\n\[\.\.\. (\d+) bytes of the server's stderr left out \.\.\.\]\n", err)
    assert gap, err
    head, tail = err[:gap.start()], err[gap.end():]
    assert len(head) == 2048 and len(tail) == 8192, (len(head), len(tail))
    assert "silent-00-" in head and "silent-63-" in tail  # the first and the last
    assert 0 < err.count("silent for") < 64
