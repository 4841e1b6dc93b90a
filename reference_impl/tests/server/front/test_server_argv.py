"""`server_argv(config)` is the inverse of `hybridkv serve`'s parse: the flags it writes give back the config."""

from __future__ import annotations

import os

import pytest
from hybridkv.server.books.config import GIB, ConfigError, ServerConfig
from hybridkv.server.front.cli import parse, server_argv
from hybridkv.server.l2.fs_spec import FsL2Spec
from hybridkv.server.l2.redis_spec import RedisL2Spec
from hybridkv.server.l2.specs import L2ConfigError

MIB = 1 << 20
TINY = 1 / 1024


def secret_file(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    p.chmod(0o600)
    return str(p)


def configs(tmp_path, monkeypatch) -> list[ServerConfig]:
    pw = secret_file(tmp_path, "pw", b"hunter2-password")
    mac = secret_file(tmp_path, "mac", b"k" * 32)
    monkeypatch.setenv("HKV_TEST_L2_PASSWORD", "from-the-environment")
    return [
        ServerConfig(l1_bytes=GIB),
        ServerConfig(l1_bytes=int(0.05 * GIB), endpoint="ipc:///tmp/hkv-argv/s.sock", admin=True),
        ServerConfig(l1_bytes=1 << 20, endpoint="tcp://127.0.0.1:5599", l1_dir="/tmp", chunk_tokens=256,
                     eviction="fifo", client_timeout_s=2.5, quarantine_s=0.0, io_threads=1, spill_watermark=0.3,
                     flush_on_exit=True, cuda_ipc=True, max_keys=8, max_message_bytes=1 << 20,
                     max_frame_bytes=1 << 24, max_clients=7, max_engines=9, max_engines_per_client=3,
                     max_leases=5, max_reservations=6, max_queued_replies=10, max_pending=11, max_prefetches=2,
                     max_retrieve_objects=12,
                     parent_pid=os.getppid()),
        ServerConfig(l1_bytes=int(TINY * GIB), l2=FsL2Spec(str(tmp_path / "l2"), int(0.1 * GIB))),
        ServerConfig(l1_bytes=3 * GIB, l2=FsL2Spec("/var/cache/hkv", 7 * GIB + 12345, fsync=True)),
        ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("redis://127.0.0.1:6379/0")),
        ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("valkey://10.0.0.2:6380/3", prefix="tenant-a:", chunk_bytes=MIB,
                                                  timeout_s=60.0, meta_timeout_s=1.0, connect_timeout_s=0.25,
                                                  max_connections=4, ttl_s=600, index_ttl_s=3.0, miss_ttl_s=0.5,
                                                  retry_after_s=0.2, username="hkv")),
        ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("redis://h:1/0", password="hunter2-password", password_file=pw,
                                                  mac_key=b"k" * 32, mac_key_file=mac)),
        ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("redis://h:1/0", password="from-the-environment",
                                                  password_env="HKV_TEST_L2_PASSWORD")),
        ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("redis+cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002",
                                                  prefix="tenant-c:", password="hunter2-password", password_file=pw)),
        ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("rediss+cluster://h1:7000,h2", tls_ca_file="/etc/ca.crt")),
    ]



def test_parse_of_server_argv_is_the_config(tmp_path, monkeypatch):
    for config in configs(tmp_path, monkeypatch):
        assert parse(server_argv(config)) == config, server_argv(config)


def test_the_users_flags_and_the_seeds_json_give_the_same_config(tmp_path):
    d = str(tmp_path / "l2")
    flags = parse(["--l1-gib", "0.25", "--l2-dir", d, "--l2-gib", "2", "--l2-fsync"])
    seed = parse(["--l1-size-gb", "0.25", "--l2-adapter", f'{{"type":"fs","base_path":"{d}","max_capacity_gb":2}}',
                  "--l2-fsync"])
    assert flags == seed == ServerConfig(l1_bytes=GIB // 4, l2=FsL2Spec(d, 2 * GIB, fsync=True))
    assert parse(server_argv(flags)) == flags


def test_a_secret_given_by_value_never_goes_on_a_command_line():
    config = ServerConfig(l1_bytes=GIB, l2=RedisL2Spec("redis://h:1/0", password="by-value"))
    with pytest.raises(L2ConfigError, match="cannot go on a command line"):
        server_argv(config)
    assert "by-value" not in repr(config)


def test_an_unchanged_default_is_not_written():
    assert server_argv(ServerConfig(l1_bytes=GIB, endpoint="ipc:///tmp/x/s.sock")) == [
        "--endpoint=ipc:///tmp/x/s.sock", "--l1-gib=1.0"]


@pytest.mark.parametrize("l1_dir", ["-x", "--admin", "--admin=1", "a=b c", "ü/dir"])
def test_a_value_that_looks_like_a_flag_stays_a_value(l1_dir):
    config = ServerConfig(l1_bytes=GIB, endpoint="ipc:///tmp/x/s.sock", l1_dir=l1_dir)
    assert parse(server_argv(config)) == config


@pytest.mark.parametrize("config,says", [
    (lambda: ServerConfig(l1_bytes=(1 << 60) + 12345, endpoint="ipc:///tmp/x/s.sock"), "does not survive --l1-gib"),
    (lambda: ServerConfig(l1_bytes=GIB, endpoint="ipc:///tmp/x/s.sock", chunk_tokens=True), "chunk_tokens must be int"),
])
def test_a_config_the_flags_cannot_carry_is_refused_not_changed(config, says):
    with pytest.raises(ConfigError, match=says):
        server_argv(config())
