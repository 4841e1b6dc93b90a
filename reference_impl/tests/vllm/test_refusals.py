"""What the connector cannot serve correctly is refused when vLLM builds it, in one line naming the setting:
no prefix caching, a load-failure policy other than recompute, a producer- or consumer-only role, pipeline
parallelism, sleep mode."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.vllm.connector import check_supported
from hybridkv.engine.vllm.settings import kv_transfer_config
from hybridkv_bench import vllm_planning as planning


@pytest.fixture(scope="module")
def base(tiny_model):
    vc = planning.vllm_config(tiny_model, planning.TINY, kv_transfer=kv_transfer_config("ipc:///tmp/unused.sock"))
    check_supported(vc)  # the configuration the tests and the README use is accepted
    return vc


@pytest.mark.parametrize("change,says", [
    (lambda vc: setattr(vc.cache_config, "enable_prefix_caching", False), r"needs --enable-prefix-caching"),
    (lambda vc: setattr(vc.kv_transfer_config, "kv_load_failure_policy", "fail"),
     r"needs kv_load_failure_policy 'recompute'.*got 'fail'"),
    (lambda vc: setattr(vc.kv_transfer_config, "kv_role", "kv_producer"), r"needs kv_role 'kv_both'.*kv_producer"),
    (lambda vc: setattr(vc.parallel_config, "pipeline_parallel_size", 2), r"--pipeline-parallel-size 1 \(got 2\)"),
    (lambda vc: setattr(vc.model_config, "enable_sleep_mode", True), r"no.* sleep mode.*--enable-sleep-mode"),
])
def test_unsupported_settings_are_refused_by_name(base, change, says):
    vc = copy.deepcopy(base)
    change(vc)
    with pytest.raises(ValueError, match=says):
        check_supported(vc)
