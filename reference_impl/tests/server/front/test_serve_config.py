"""`hybridkv serve --config FILE` and HYBRIDKV_<FLAG> variables: flags over variables over the file over defaults,
an unknown key or a bad value refused in one line naming where it came from, and --print-config showing the merged
settings as a file that --config takes back."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hybridkv.cli import UserError
from hybridkv.server.books.config import GIB
from hybridkv.server.front.cli import parse_args, server_config
from hybridkv.server.l2.fs_spec import FsL2Spec
from hybridkv.settings_sources import OTHER_ENV, env_name


def serve(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDKV_")}
    return subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", *args], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=timeout)


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "hybridkv.toml"
    p.write_text(text)
    return str(p)


def test_flags_over_variables_over_the_file(tmp_path):
    path = write(tmp_path, 'l1-gib = 2\nmax_keys = 100\nio-threads = 2\nflush-on-exit = true\neviction = "fifo"\n'
                           '[l2-adapter]\ntype = "fs"\nbase_path = "/srv/l2"\nmax_capacity_gb = 3\n')
    env = {"HYBRIDKV_MAX_KEYS": "50", "HYBRIDKV_IO_THREADS": "5", "HYBRIDKV_ADMIN": "yes"}
    args = parse_args(["--config", path, "--io-threads", "3"], env)
    cfg = server_config(args)
    assert cfg.l1_bytes == 2 * GIB           # the file
    assert cfg.max_keys == 50                # a variable over the file
    assert cfg.io_threads == 3               # the flag over both
    assert cfg.admin and cfg.flush_on_exit and cfg.eviction == "fifo"
    assert cfg.l2 == FsL2Spec("/srv/l2", 3 * GIB, False)  # the L2 as a table
    assert args.settings["max-keys"].source == "HYBRIDKV_MAX_KEYS"
    assert args.settings["l1-gib"].source == f"--config {path}"
    assert args.settings["io-threads"].source == "flag" and args.settings["quarantine"].source == "default"


def test_hybridkv_config_names_the_file_and_a_variable_alone_works(tmp_path):
    path = write(tmp_path, "max-leases = 7\n")
    cfg = server_config(parse_args([], {"HYBRIDKV_CONFIG": path, "HYBRIDKV_L1_GIB": "0.5"}))
    assert cfg.max_leases == 7 and cfg.l1_bytes == GIB // 2


def test_port_flag_over_an_endpoint_from_the_file(tmp_path):
    path = write(tmp_path, 'endpoint = "tcp://127.0.0.1:6000"\n')
    assert server_config(parse_args(["--config", path, "--port", "6001"])).endpoint == "tcp://127.0.0.1:6001"
    with pytest.raises(UserError, match="give one"):
        server_config(parse_args(["--endpoint", "tcp://127.0.0.1:6000", "--port", "6001"]))


@pytest.mark.parametrize("text, message", [
    ("l1-size = 4\n", "unknown key 'l1-size' (did you mean 'l1-gib'?)"),
    ("l1-size-gb = 4\n", "unknown key 'l1-size-gb'"),   # the seed's flags are the command line's alone
    ("port = 5555\n", "unknown key 'port'"),
    ('max-keys = "many"\n', "max-keys in {path}: invalid int value 'many'"),
    ("max-keys = 1.5\n", "max-keys in {path}: invalid int value 1.5"),
    ("admin = 1\n", "admin in {path} must be true or false, got 1"),
    ('eviction = "mru"\n', "eviction in {path} must be one of ['fifo', 'lru'], got 'mru'"),
    ("l1-gib = true\n", "l1-gib in {path} must be a float, got True"),
    ("l1-gib = [1]\n", "l1-gib in {path} must be a float, got [1]"),
    ("l1-gib = \n", "--config {path}: not TOML: "),
])
def test_a_bad_file_is_one_line(tmp_path, text, message):
    path = write(tmp_path, text)
    r = serve("--config", path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("hybridkv serve: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert message.format(path=path) in r.stderr


@pytest.mark.parametrize("env, message", [
    ({"HYBRIDKV_L1_GB": "4"}, "unknown environment variable HYBRIDKV_L1_GB (did you mean HYBRIDKV_L1_GIB?)"),
    ({"HYBRIDKV_LOAD_MOD": "x"},
     "HYBRIDKV_LOAD_MOD (did you mean HYBRIDKV_LOAD_MODE, which the vLLM connector reads?)"),
    ({"HYBRIDKV_CONFG": "x"}, "unknown environment variable HYBRIDKV_CONFG (did you mean HYBRIDKV_CONFIG?)"),
    ({"HYBRIDKV_ADMIN": "maybe"}, "HYBRIDKV_ADMIN must be true or false, got 'maybe'"),
    ({"HYBRIDKV_MAX_LEASES": "lots"}, "HYBRIDKV_MAX_LEASES: invalid int value 'lots'"),
    ({"HYBRIDKV_L1_GIB": "-1"}, "L1 size (--l1-gib) must be above 0"),
    ({"HYBRIDKV_CONFIG": "/nonexistent/hkv.toml"}, "--config /nonexistent/hkv.toml: No such file or directory"),
])
def test_a_bad_variable_is_one_line(env, message):
    r = serve("--print-config", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_the_list_of_serves_variables_is_its_flags():
    """The connector refuses a HYBRIDKV_ variable no part reads by settings_sources.SERVE_ENV: serve's flags."""
    from hybridkv.server.front.cli import SEED_ALIASES, SEED_REPLACED, add_arguments
    from hybridkv.settings_sources import SERVE_ENV, keys_of

    p = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(p)
    assert set(map(env_name, keys_of(p, (*SEED_REPLACED, *SEED_ALIASES)))) == SERVE_ENV


def test_variables_other_parts_read_are_left_alone():
    """The connector's settings are HYBRIDKV_ variables serve does not refuse."""
    from hybridkv.engine.vllm.settings import ConnectorSettings

    assert {env_name(f.name) for f in fields(ConnectorSettings)} - {"HYBRIDKV_ENDPOINT"} <= OTHER_ENV
    r = serve("--print-config", env={"HYBRIDKV_SALT": "tenant", "HYBRIDKV_ENDPOINT":
                                     "tcp://127.0.0.1:7000"})
    assert r.returncode == 0, r.stderr
    assert 'endpoint = "tcp://127.0.0.1:7000"  # HYBRIDKV_ENDPOINT' in r.stdout


def test_print_config_is_a_file_config_takes_back(tmp_path):
    path = write(tmp_path, '[l2-adapter]\ntype = "fs"\nbase_path = "/srv/l2 \\"x\\""\nmax_capacity_gb = 2\n')
    argv = ["--config", path, "--l1-gib", "1.5", "--max-engines", "9", "--admin", "--metrics-port", "0"]
    env = {"HYBRIDKV_EVICTION": "fifo", "HYBRIDKV_CLIENT_TIMEOUT": "7.5"}
    r = serve(*argv, "--print-config", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "l1-gib = 1.5  # flag" in out and 'eviction = "fifo"  # HYBRIDKV_EVICTION' in out
    assert f"[l2-adapter]  # --config {path}" in out and "# l2-dir: not set (default)" in out
    again = tmp_path / "printed.toml"
    again.write_text(out)
    first, second = parse_args(argv, env), parse_args(["--config", str(again)])
    assert server_config(first) == server_config(second)
    assert second.metrics_port == 0 and second.log_level == "info"


def test_a_server_runs_from_a_file(tmp_path, sock_dir):
    path = write(tmp_path, f'endpoint = "ipc://{sock_dir}/c.sock"\nl1-gib = 0.03\nmax-engines = 3\n')
    p = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--config", path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HYBRIDKV_MAX_ENGINES": "4"})
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith(f"hybridkv server ready: endpoint=ipc://{sock_dir}/c.sock l1=0.03GiB"), line
        r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "status", "--endpoint", f"ipc://{sock_dir}/c.sock"],
                           capture_output=True, text=True, timeout=60)
        assert "engines 0 of 4 " in r.stdout, r
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert p.returncode == 0


def test_a_launched_server_runs_its_config_alone(server_factory, monkeypatch):
    """The harness's and the tests' servers take no HYBRIDKV_ variable of the process that starts them."""
    monkeypatch.setenv("HYBRIDKV_MAX_ENGINES", "3")
    server = server_factory(admin=False)
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "status", "--endpoint", server.endpoint],
                       capture_output=True, text=True, timeout=60)
    assert "engines 0 of 1,024 " in r.stdout, r


def test_a_config_that_is_no_settings_file_is_refused_before_it_is_read(tmp_path):
    """A FIFO (whose open waited for a writer forever), a device such as /dev/zero (read whole: it filled the RAM)
    or a file of megabytes is one line, at once."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    r = serve("--config", str(fifo), timeout=30)
    assert r.returncode == 2 and r.stderr == f"hybridkv serve: error: --config {fifo}: not a regular file\n"
    big = write(tmp_path, "# padding\n" * 200_000)
    r = serve("--config", big, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "2000000 B; a settings file holds at most" in r.stderr


@pytest.mark.parametrize("text, key", [
    ('endpoint = "ipc:///tmp/hkv\\u0000.sock"\n', "endpoint"),  # libzmq would bind the path cut at the NUL
    ('[l2-adapter]\ntype = "fs"\nbase_path = "/srv/l2\\u0000x"\n', "l2-adapter"),
])
def test_a_nul_character_in_a_file_value_is_one_line(tmp_path, text, key):
    """No flag or variable can hold a NUL; a TOML string can, and the server's start ended in a traceback."""
    path = write(tmp_path, text)
    r = serve("--config", path, "--l1-gib", "0.01")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert f"{key} in {path} holds a NUL character" in r.stderr


@pytest.mark.parametrize("argv", [
    ("--metrics-port", "70000"),
    ("--metrics-host", "999.1.1.1", "--metrics-port", "0"),
    ("--headline-interval", "-1"),
    ("--headline-interval", "nan"),
    ("--l1-gib", "inf"),
    ("--l2-gib", "1"),
    ("--io-threads", "0"),
    ("--endpoint", "tcp://0.0.0.0:5555"),
    ("--port", "5555", "--endpoint", "tcp://127.0.0.1:5556"),
    ("--host", "0.0.0.0"),
    ("--l2-adapter", '{"type":"s3"}'),
])
def test_print_config_refuses_what_serve_refuses(argv):
    """One check for both: `--print-config` is no way to write a file that `serve` then refuses (a metrics address,
    a headline interval were checked by serve alone)."""
    served, printed = serve(*argv), serve(*argv, "--print-config")
    assert served.returncode == printed.returncode == 2 and printed.stdout == ""
    assert printed.stderr == served.stderr and printed.stderr.count("\n") == 1, (served.stderr, printed.stderr)


def _other_value(key: str, action):
    """A value of `key` that is not its default and that serve takes, for the round trip of every key."""
    given = {"endpoint": "tcp://127.0.0.1:6123", "l1-dir": "/tmp/arena dir", "l2-dir": None, "l2-gib": None,
             "metrics-host": "::1", "metrics-port": 9411, "max-clients": 77, "chunk-tokens": 96,
             "l2-adapter": '{"type": "fs", "base_path": "/srv/l2 \\"q\\"", "max_capacity_gb": 1.5, "fsync": true}'}
    if key in given:
        return given[key]
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if action.type is None and isinstance(action.default, bool):
        return not action.default
    return action.type(action.default) + 3 if action.type is int else action.default * 1.5 + 0.25


def test_print_config_round_trips_every_key(tmp_path):
    """Every key set away from its default (by variables), printed, and read back by --config: the same value
    for each key, each now from the file (a new flag is in this test by itself: `keys_of`)."""
    from hybridkv.server.front.cli import SEED_ALIASES, SEED_REPLACED, add_arguments
    from hybridkv.settings_sources import keys_of

    p = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(p)
    keys = keys_of(p, (*SEED_REPLACED, *SEED_ALIASES))
    values = {k: _other_value(k, a) for k, a in keys.items()}
    env = {env_name(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items() if v is not None}
    r = serve("--print-config", env=env)
    assert r.returncode == 0, r.stderr
    printed = tmp_path / "printed.toml"
    printed.write_text(r.stdout)
    first, again = parse_args([], env), parse_args(["--config", str(printed)])
    for key, action in keys.items():
        assert getattr(again, action.dest) == getattr(first, action.dest), key
        # a default is printed too (the file pins it); a key without a value is a comment
        assert again.settings[key].source == (f"--config {printed}" if getattr(first, action.dest) is not None
                                              else "default"), key
    assert server_config(first) == server_config(again)
