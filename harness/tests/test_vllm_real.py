"""The `vllm-real` engine kind's scenario files: the shipped one decodes, and bad values are refused naming
them (the engine itself needs vLLM: reference_impl/tests/vllm_engine, `nox -s vllm_engine`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridkv.model.presets import model_config
from hybridkv_bench.vllm_real import ModelShape, load_ttft_scenario

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
    ('name = "x"\n[model]\npreset = "gemma-3-27b"\n', "model preset must be one of .*tiny-hybrid"),
    ('name = "x\n', "not a readable TOML"),
])
def test_bad_vllm_real_scenarios_are_refused_by_name(tmp_path, text, needle):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_ttft_scenario(f)


def test_a_real_model_shape_is_its_preset_with_the_scenarios_keys():
    """The one model shape: what the scenario's [model] keys do not set (linear head dims, conv kernel, dtypes) is
    the preset's, and the layout of the written model is the preset layout of that config."""
    base = model_config("qwen3-next-80b-a3b")
    cfg = load_ttft_scenario(SCENARIOS / "ttft_cpu.toml").model.config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (
        8, 1024, 8, 4, 128)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.full_attention_interval) == (1, 2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.ssm_dtype) == (
        base.linear_key_head_dim, base.linear_value_head_dim, base.linear_conv_kernel_dim, base.ssm_dtype)
    assert [g.kind for g in cfg.layout().groups] == ["recurrent"] * 3 + ["attention"]
    assert ModelShape(preset="tiny-hybrid").config().linear_key_head_dim == 16
