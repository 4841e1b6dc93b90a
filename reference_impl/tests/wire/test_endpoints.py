"""One endpoint rule for `hybridkv serve`, `hybridkv status` and the vLLM connector: $HYBRIDKV_ENDPOINT when set,
else ipc:///tmp/hybridkv-UID/server.sock whatever the process's session ($XDG_RUNTIME_DIR moved the server's socket
in a login shell while a vLLM started elsewhere looked in /tmp); the README's commands use it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hybridkv.engine.vllm.settings import ConnectorSettings, no_server_at_start
from hybridkv.wire.endpoints import default_endpoint

ROOT = Path(__file__).resolve().parents[3]


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDKV_", "XDG_"))}
    return subprocess.run([sys.executable, "-m", "hybridkv.cli", *args], capture_output=True, text=True,
                          env={**clean, **env}, timeout=60)


def test_the_default_does_not_depend_on_the_session(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_endpoint() == f"ipc:///tmp/hybridkv-{os.getuid()}/server.sock"
    assert ConnectorSettings.from_extra({}, {}).endpoint == default_endpoint()
    for env in ({"XDG_RUNTIME_DIR": str(tmp_path)}, {}):
        serve = run("serve", "--print-config", env=env)
        assert f'endpoint = "{default_endpoint()}"  # default' in serve.stdout, serve
        status = run("status", "--timeout", "0.2", env=env)
        assert f"no cache server at {default_endpoint()}" in status.stderr or default_endpoint() in status.stderr


def test_hybridkv_endpoint_reaches_all_three(server_factory):
    server = server_factory(admin=False)
    env = {"HYBRIDKV_ENDPOINT": server.endpoint}
    status = run("status", env=env)
    assert status.returncode == 0 and f"hybridkv server at {server.endpoint}" in status.stdout, status
    serve = run("serve", "--print-config", env=env)
    assert f'endpoint = "{server.endpoint}"  # HYBRIDKV_ENDPOINT' in serve.stdout
    assert ConnectorSettings.from_extra({}, env).endpoint == server.endpoint
    # kv_connector_extra_config over the variable
    assert ConnectorSettings.from_extra({"endpoint": "tcp://127.0.0.1:7"}, env).endpoint == "tcp://127.0.0.1:7"


def test_connector_settings_from_variables():
    s = ConnectorSettings.from_extra({"timeout_s": 5}, {"HYBRIDKV_TIMEOUT_S": "9", "HYBRIDKV_LOAD_MODE": "layerwise",
                                                         "HYBRIDKV_SALT": "tenant-a"})
    assert (s.timeout_s, s.load_mode, s.salt) == (5, "layerwise", "tenant-a")
    for env, message in (({"HYBRIDKV_LOAD_MODE": "eager"}, "HYBRIDKV_LOAD_MODE must be one of ('async', 'layerwise')"),
                         ({"HYBRIDKV_RETRY_S": "soon"}, "HYBRIDKV_RETRY_S must be float, got 'soon'")):
        try:
            ConnectorSettings.from_extra({}, env)
        except ValueError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{env} taken")


def test_connector_settings_from_a_file_beneath_variables_and_extra_config(tmp_path):
    f = tmp_path / "connector.toml"
    f.write_text('timeout_s = 7.0\nload-mode = "layerwise"\nsalt = "from-file"\nretry_s = 3.0\n')
    s = ConnectorSettings.from_extra({"config": str(f), "salt": "from-extra"}, {"HYBRIDKV_RETRY_S": "4"})
    assert (s.timeout_s, s.load_mode, s.salt, s.retry_s) == (7.0, "layerwise", "from-extra", 4.0)
    assert ConnectorSettings.from_extra({}, {"HYBRIDKV_CONNECTOR_CONFIG": str(f)}).salt == "from-file"
    for text, message in (("nonsense = 1\n", "unknown keys ['nonsense']"), ("timeout_s = [", ": not TOML: "),
                          ('load_mode = "eager"\n', "load_mode must be one of")):
        f.write_text(text)
        try:
            ConnectorSettings.from_extra({"config": str(f)}, {})
        except ValueError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"{text!r} taken")
    try:
        ConnectorSettings.from_extra({"config": str(tmp_path / "none.toml")}, {})
    except ValueError as e:
        assert "none.toml" in str(e)
    else:
        raise AssertionError("a missing file taken")


def test_the_readme_vllm_line_uses_the_rule():
    """The README's `vllm serve` line names no endpoint of its own: the connector then looks where `hybridkv
    serve` listens by default, in whichever session each runs."""
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"--kv-transfer-config '(\{.*?\})'", readme, re.S)
    assert line, "no --kv-transfer-config in the README"
    config = json.loads(line[1])
    assert "endpoint" not in config.get("kv_connector_extra_config", {})
    assert ConnectorSettings.from_extra(config.get("kv_connector_extra_config"), {}).endpoint == default_endpoint()


def test_a_connector_without_a_server_says_where_it_looked(sock_dir):
    s = ConnectorSettings.from_extra({}, {})
    line = no_server_at_start(s, TimeoutError("no reply in 1 s"))
    assert f"NO CACHE SERVER at {default_endpoint()} (the default, where `hybridkv serve` listens" in line
    s = ConnectorSettings.from_extra({}, {"HYBRIDKV_ENDPOINT": f"ipc://{sock_dir}/x.sock"})
    line = no_server_at_start(s, TimeoutError("no reply in 1 s"))
    assert f"the socket file {sock_dir}/x.sock does not exist" in line and "HYBRIDKV_ENDPOINT" in line


def test_the_connector_reads_its_file_and_variables_by_the_servers_rules(tmp_path):
    """As `hybridkv serve` does: a file that is no settings file (a FIFO, whose open waited for a writer forever),
    bytes that are not UTF-8 and a NUL character are one line naming the file; a HYBRIDKV_ variable no part reads
    (a typo) is refused, naming the likeliest meant, where it was silently no setting."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    f = tmp_path / "c.toml"
    for path, text, message in ((fifo, None, f"connector config file {fifo}: not a regular file"),
                                (f, b"salt = '\xff'\n", f"connector config file {f}: not TOML: not UTF-8"),
                                (f, b'endpoint = "ipc:///tmp/x\\u0000.sock"\n',
                                 f"connector config file {f}: endpoint holds a NUL character")):
        if text is not None:
            path.write_bytes(text)
        with pytest.raises(ValueError) as e:
            ConnectorSettings.from_extra({"config": str(path)}, {})
        assert str(e.value).startswith(message) and "\n" not in str(e.value), e.value
    with pytest.raises(ValueError, match=r"^unknown environment variable HYBRIDKV_LOAD_MOD \(did you mean "
                                         r"HYBRIDKV_LOAD_MODE\?\); the connector's"):
        ConnectorSettings.from_extra({}, {"HYBRIDKV_LOAD_MOD": "layerwise"})
    # the server's variables, and both files' names, are some part's: the connector leaves them alone
    s = ConnectorSettings.from_extra({}, {"HYBRIDKV_L1_GIB": "8", "HYBRIDKV_CONFIG": "/srv/hkv.toml",
                                          "HYBRIDKV_SALT": "t"})
    assert s.salt == "t"
