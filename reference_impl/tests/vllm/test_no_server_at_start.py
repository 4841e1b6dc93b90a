"""A connector that finds no cache server as it starts says so in an error line naming where it looked (before, one
warning said "unreachable" and offload silently did nothing)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")


def test_no_server_at_start_is_an_error_naming_where_it_looked(sock_dir, make_engine, caplog):
    endpoint = f"ipc://{sock_dir}/nobody.sock"
    with caplog.at_level(logging.ERROR, logger="hybridkv"):
        make_engine(endpoint, lookup_timeout_s=0.3, timeout_s=1.0)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("hybridkv")]
    assert len(errors) == 1, errors
    assert f"NO CACHE SERVER at {endpoint} (from kv_connector_extra_config's endpoint or $HYBRIDKV_ENDPOINT)" \
        in errors[0]
    assert f"the socket file {sock_dir}/nobody.sock does not exist" in errors[0]
    assert "Offload does nothing until a server answers there" in errors[0]
