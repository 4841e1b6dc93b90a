"""The `vllm-real` engine kind's scenario files: the shipped one decodes, and bad values are refused naming
them (the engine itself needs vLLM: reference_impl/tests/vllm_engine, `nox -s vllm_engine`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridkv_bench.vllm_real import load_ttft_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios" / "vllm_real"


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_the_shipped_vllm_real_scenarios_decode(path):
    sc = load_ttft_scenario(path)
    assert sc.engine == "vllm-real" and sc.prompt_tokens


@pytest.mark.parametrize("text,needle", [
    ('name = "x"\nprompt_tokens = []\n', "prompt_tokens"),
    ('name = "x"\nprompt_tokens = [100000]\n', "max_model_len"),
    ('name = "x"\nkv_cache_gib = inf\n', "kv_cache_gib"),
    ('name = "x"\nengine = "sim"\n', "engine"),
    ('name = "x"\n[model]\nlayers = 6\n', "full_attention_interval"),
    ('name = "x"\n[model]\nlayrs = 8\n', "layrs"),
    ('name = "x"\nrepeats = 0\n', "repeats"),
    ('name = "x\n', "not a readable TOML"),
])
def test_bad_vllm_real_scenarios_are_refused_by_name(tmp_path, text, needle):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_ttft_scenario(f)
