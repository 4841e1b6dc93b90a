"""One identity per model under vLLM: the connector keys chunks by the served model's config and weights, so the
same checkpoint served from two paths shares chunks and another config at the same path does not."""

from __future__ import annotations

import shutil

import pytest

# "vllm.config", not "vllm": without vLLM, this folder would import as a namespace package named vllm
pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv_bench import vllm_planning as planning
from vllmkit import C, run, sched_stats, tokens, worker_stats


def hit_tokens(make_engine, endpoint: str, model, prompt: list[int]) -> int:
    """External hit tokens of `prompt` in a new engine (its own scheduler: vLLM's local cache is empty)."""
    eng = make_engine(endpoint, model=model)
    run(eng, "B", prompt)
    return sched_stats(eng).hit_tokens


def test_one_model_at_two_paths_shares_and_two_configs_at_one_path_do_not(serve, make_engine, model_dir):
    srv = serve()
    a_dir = planning.write_config(planning.TINY, model_dir / "served-here", weights_seed=0)
    b_dir = shutil.copytree(a_dir, model_dir / "and-there")
    a, b = (planning.model_config(d, max_model_len=4096) for d in (a_dir, b_dir))
    eng = make_engine(srv.endpoint, model=a)
    assert eng.layout.model.startswith("Qwen3NextForCausalLM@") and "served-here" not in eng.layout.model
    prompt = tokens(3 * C + 7, 30)
    run(eng, "A", prompt)
    eng.worker.worker_side.wait_idle(10)
    assert worker_stats(eng).stores >= 1
    assert hit_tokens(make_engine, srv.endpoint, b, prompt) == 3 * C  # the same checkpoint, another path
    # the same path, another config (one that leaves the KV-cache layout as it was): nothing shared
    planning.write_config(planning.TINY, a_dir, weights_seed=0, rms_norm_eps=1e-5)
    assert hit_tokens(make_engine, srv.endpoint, planning.model_config(a_dir, max_model_len=4096), prompt) == 0
