"""A Mamba-2 hybrid (Nemotron-H-8B's shape) through vLLM's own model class and planner: the state shapes and
dtypes come from vLLM's NemotronHForCausalLM, the groups from vLLM's hybrid planner, and the layout the
connector derives from that KVCacheConfig equals hybridkv's `nemotron-h-8b` preset at TP 1, 2 and 8 (group
order, which layers share a group, block tokens, page bytes), MLP layers in no group."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.vllm.layout_from_vllm import check_matches_preset, layout_from_kv_cache_config
from hybridkv.layout import layer_index
from hybridkv.presets import MAMBA2_CONFIGS, preset_layout
from hybridkv_bench import vllm_planning as planning

CFG = MAMBA2_CONFIGS["nemotron-h-8b"]


@pytest.fixture(scope="module")
def nemotron(model_dir):
    from transformers import NemotronHConfig

    d = model_dir / "nemotron-h-8b"
    NemotronHConfig(num_hidden_layers=CFG.num_layers, hybrid_override_pattern=CFG.pattern, hidden_size=CFG.hidden_size,
                    num_attention_heads=CFG.num_attention_heads, num_key_value_heads=CFG.num_kv_heads,
                    head_dim=CFG.head_dim, mamba_num_heads=CFG.mamba_num_heads, mamba_head_dim=CFG.mamba_head_dim,
                    ssm_state_size=CFG.ssm_state_size, n_groups=CFG.n_groups, conv_kernel=CFG.conv_kernel,
                    mamba_ssm_cache_dtype=CFG.ssm_dtype, intermediate_size=21504, vocab_size=131072,
                    architectures=["NemotronHForCausalLM"], torch_dtype="bfloat16").save_pretrained(d)
    return planning.model_config(d, max_model_len=4096)


def _kv_cache_config(mc, tp: int):
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM as Model
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    class Shape:
        ssm_dtype = CFG.ssm_dtype

    vc = planning.vllm_config(mc, Shape, tp=tp)
    cc = vc.cache_config
    specs = {}
    for i, kind in enumerate(mc.hf_text_config.layers_block_type):  # as NemotronH's layers report their specs
        if kind == "full_attention":
            specs[f"backbone.layers.{i}.mixer.attn"] = FullAttentionSpec(
                block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                head_size=mc.get_head_size(), dtype=mc.dtype)
        elif kind in ("linear_attention", "mamba"):
            specs[f"backbone.layers.{i}.mixer"] = MambaSpec(
                shapes=Model.get_mamba_state_shape_from_config(vc), dtypes=Model.get_mamba_state_dtype_from_config(vc),
                block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.MAMBA2, mamba_cache_mode=cc.mamba_cache_mode)
    resolve_kv_cache_layout(vc, [["LBHNC"]], specs.values())
    groups = get_global_kv_cache_groups(vc, [specs])
    page = max(s.page_size_bytes for s in specs.values())
    return get_kv_cache_configs(vc, [specs], [64 * page * max(len(g.layer_names) for g in groups)], groups)[0]


@pytest.mark.parametrize("tp,page", [(1, 4_259_840), (2, 2_129_920), (8, 532_480)])
def test_vllm_planner_layout_equals_the_mamba2_preset(nemotron, tp, page):
    got = layout_from_kv_cache_config(_kv_cache_config(nemotron, tp), CFG.name, tp)
    want = preset_layout("nemotron-h-8b", tp)
    # an fp32 SSM state of 128 x 64 x 128 per head group dominates the page: 1040-token attention blocks
    assert {(g.block_tokens, g.page_bytes) for g in got.groups} == {(1040, page)}
    assert got.signature() == want.signature()
    check_matches_preset(got, "nemotron-h-8b")
    assert [g.kind for g in got.groups] == ["recurrent"] * 6 + ["attention"]
    cached = {layer_index(n) for g in got.groups for n in g.layer_names}
    assert cached == {i for i, c in enumerate(CFG.pattern) if c in "M*"}  # the MLP layers keep nothing
    assert got.fingerprint() == want.fingerprint()
