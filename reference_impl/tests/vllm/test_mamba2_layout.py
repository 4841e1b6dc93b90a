"""Mamba hybrids at their real sizes through vLLM's own model classes and planner: the state shapes and dtypes come
from vLLM's model class (NemotronH, GraniteMoeHybrid, FalconH1, Jamba), the groups from vLLM's hybrid planner over
the layers as each class registers them, and the layout the connector derives from that KVCacheConfig equals the
hybridkv preset at TP 1, 2 and 8 (group order, which layers share a group, block tokens, page bytes); MLP and MoE
layers are in no group. Falcon-H1 keeps an attention and a Mamba-2 cache in every layer (two groups: all attention,
all Mamba); Jamba's Mamba-1 layers at 1:7 make seven Mamba groups of four and one attention group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.vllm.layout_from_vllm import check_matches_preset, layout_from_kv_cache_config
from hybridkv.model.layout import LayoutError, layer_index
from hybridkv.model.presets import preset_layout
from hybridkv.model.presets.mamba1 import PRESETS as MAMBA1_CONFIGS
from hybridkv.model.presets.mamba2 import PRESETS as MAMBA2_CONFIGS
from hybridkv_bench import vllm_planning as planning


@dataclass(frozen=True)
class Case:
    """A preset, the transformers config of its model, and the cache layers as vLLM's model class registers them:
    (name, 'attention' | 'mamba') in order."""

    cfg: object
    hf_config: Callable[[], object]
    model_class: str  # vllm.model_executor.models.<module>.<class>
    cache_layers: Callable[[object], list[tuple[str, str]]]
    mamba_type: str = "MAMBA2"


def _nemotron():
    from transformers import NemotronHConfig

    c = MAMBA2_CONFIGS["nemotron-h-8b"]
    return NemotronHConfig(num_hidden_layers=c.num_layers, hybrid_override_pattern=c.pattern, hidden_size=c.hidden_size,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_kv_heads,
                           head_dim=c.head_dim, mamba_num_heads=c.mamba_num_heads, mamba_head_dim=c.mamba_head_dim,
                           ssm_state_size=c.ssm_state_size, n_groups=c.n_groups, conv_kernel=c.conv_kernel,
                           mamba_ssm_cache_dtype=c.ssm_dtype, intermediate_size=21504, vocab_size=131072,
                           architectures=["NemotronHForCausalLM"], torch_dtype="bfloat16")


def _nemotron_layers(hf):
    out = []
    for i, kind in enumerate(hf.layers_block_type):
        if kind == "full_attention":
            out.append((f"backbone.layers.{i}.mixer.attn", "attention"))
        elif kind in ("linear_attention", "mamba"):
            out.append((f"backbone.layers.{i}.mixer", "mamba"))
    return out


def _granite(name: str, experts: int):
    def make():
        from transformers import GraniteMoeHybridConfig

        c = MAMBA2_CONFIGS[name]
        kinds = {"M": "mamba", "*": "attention"}
        return GraniteMoeHybridConfig(
            num_hidden_layers=c.num_layers, layer_types=[kinds[ch] for ch in c.pattern], hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_kv_heads,
            mamba_n_heads=c.mamba_num_heads, mamba_d_head=c.mamba_head_dim, mamba_d_state=c.ssm_state_size,
            mamba_n_groups=c.n_groups, mamba_d_conv=c.conv_kernel, mamba_expand=2, intermediate_size=512,
            shared_intermediate_size=1024, num_local_experts=experts, num_experts_per_tok=min(experts, 6),
            position_embedding_type="nope", max_position_embeddings=131072, vocab_size=100352,
            architectures=["GraniteMoeHybridForCausalLM"], torch_dtype="bfloat16")
    return make


def _granite_layers(hf):
    # transformers names them as vLLM's Granite model reads them: "linear_attention" (Mamba-2), "full_attention"
    return [(f"model.layers.{i}.self_attn.attn", "attention") if t in ("attention", "full_attention")
            else (f"model.layers.{i}.mixer", "mamba") for i, t in enumerate(hf.layer_types)]


def _falcon():
    from transformers import FalconH1Config

    c = MAMBA2_CONFIGS["falcon-h1-0.5b"]
    return FalconH1Config(num_hidden_layers=c.num_layers, hidden_size=c.hidden_size,
                          num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_kv_heads,
                          head_dim=c.head_dim, mamba_d_ssm=c.mamba_num_heads * c.mamba_head_dim,
                          mamba_n_heads=c.mamba_num_heads, mamba_d_head=c.mamba_head_dim,
                          mamba_d_state=c.ssm_state_size, mamba_n_groups=c.n_groups, mamba_d_conv=c.conv_kernel,
                          intermediate_size=2048, vocab_size=32784, architectures=["FalconH1ForCausalLM"],
                          torch_dtype="bfloat16")


def _falcon_layers(hf):
    # FalconH1ParallelHybrid builds its attention branch first, then its SSM branch under index num_layers + i
    n = hf.num_hidden_layers
    return [x for i in range(n) for x in ((f"model.layers.{i}.attn", "attention"), (f"model.{n + i}.mixer", "mamba"))]


def _jamba():
    from transformers import JambaConfig

    hf = JambaConfig(architectures=["JambaForCausalLM"], torch_dtype="bfloat16")  # its defaults are Jamba-v0.1's
    c = MAMBA1_CONFIGS["jamba-v0.1"]
    assert (hf.num_hidden_layers, hf.attn_layer_period, hf.attn_layer_offset, hf.hidden_size,
            hf.num_attention_heads, hf.num_key_value_heads, hf.mamba_expand * hf.hidden_size, hf.mamba_d_state,
            hf.mamba_d_conv) == (c.num_layers, c.attn_layer_period, c.attn_layer_offset, c.hidden_size,
                                 c.num_attention_heads, c.num_kv_heads, c.mamba_intermediate, c.ssm_state_size,
                                 c.conv_kernel)
    return hf


def _jamba_layers(hf):
    return [(f"model.layers.{i}.self_attn.attn", "attention") if t == "attention"
            else (f"model.layers.{i}.mixer", "mamba") for i, t in enumerate(hf.layers_block_type)]


CASES = {
    "nemotron-h-8b": Case(MAMBA2_CONFIGS["nemotron-h-8b"], _nemotron, "nemotron_h.NemotronHForCausalLM",
                          _nemotron_layers),
    "granite-4.0-h-micro": Case(MAMBA2_CONFIGS["granite-4.0-h-micro"], _granite("granite-4.0-h-micro", 0),
                                "granitemoehybrid.GraniteMoeHybridForCausalLM", _granite_layers),
    "granite-4.0-h-tiny": Case(MAMBA2_CONFIGS["granite-4.0-h-tiny"], _granite("granite-4.0-h-tiny", 64),
                               "granitemoehybrid.GraniteMoeHybridForCausalLM", _granite_layers),
    "granite-4.0-h-small": Case(MAMBA2_CONFIGS["granite-4.0-h-small"], _granite("granite-4.0-h-small", 72),
                                "granitemoehybrid.GraniteMoeHybridForCausalLM", _granite_layers),
    "falcon-h1-0.5b": Case(MAMBA2_CONFIGS["falcon-h1-0.5b"], _falcon, "falcon_h1.FalconH1ForCausalLM",
                           _falcon_layers),
    "jamba-v0.1": Case(MAMBA1_CONFIGS["jamba-v0.1"], _jamba, "jamba.JambaForCausalLM", _jamba_layers, "MAMBA1"),
}


@pytest.fixture(scope="module")
def model_configs(model_dir):
    """vLLM's ModelConfig of each case's config (built lazily: vLLM inspects each architecture in a subprocess)."""
    made: dict[str, object] = {}

    def get(name: str):
        if name not in made:
            d = model_dir / name
            CASES[name].hf_config().save_pretrained(d)
            made[name] = planning.model_config(d, max_model_len=4096)
        return made[name]

    return get


def _kv_cache_config(case: Case, mc, tp: int):
    import importlib

    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    module, cls = case.model_class.rsplit(".", 1)
    Model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)

    class Shape:
        ssm_dtype = case.cfg.ssm_dtype

    vc = planning.vllm_config(mc, Shape, tp=tp)
    cc = vc.cache_config
    specs = {}
    for name, kind in case.cache_layers(mc.hf_text_config):
        if kind == "attention":
            specs[name] = FullAttentionSpec(block_size=cc.block_size, head_size=mc.get_head_size(), dtype=mc.dtype,
                                            num_kv_heads=mc.get_num_kv_heads(vc.parallel_config))
        else:
            specs[name] = MambaSpec(shapes=Model.get_mamba_state_shape_from_config(vc),
                                    dtypes=Model.get_mamba_state_dtype_from_config(vc), block_size=cc.mamba_block_size,
                                    page_size_padded=cc.mamba_page_size_padded,
                                    mamba_type=getattr(MambaAttentionBackendEnum, case.mamba_type),
                                    mamba_cache_mode=cc.mamba_cache_mode)
    resolve_kv_cache_layout(vc, [["LBHNC"]], specs.values())
    groups = get_global_kv_cache_groups(vc, [specs])
    page = max(s.page_size_bytes for s in specs.values())
    return get_kv_cache_configs(vc, [specs], [1024 * page * max(len(g.layer_names) for g in groups)], groups)[0]


# (block tokens, page bytes) vLLM's planner gives each preset per TP size, and its groups' kinds in order
EXPECTED = {
    # an fp32 SSM state of 128 x 64 x 128 per head group dominates the page: 1040-token attention blocks
    "nemotron-h-8b": ({1: (1040, 4_259_840), 2: (1040, 2_129_920), 8: (1040, 532_480)}, "r" * 6 + "a"),
    # 36 Mamba-2 layers and 4 attention: groups of 4 (nine Mamba, one attention); the one Mamba group is
    # replicated per rank from TP 2 on (vLLM's extra_groups_for_head_shards)
    "granite-4.0-h-micro": ({1: (528, 1_081_344), 2: (528, 540_672), 8: (544, 139_264)}, "r" * 9 + "a"),
    # 12 attention heads: no TP 8 (vLLM refuses it; so does the preset)
    "granite-4.0-h-tiny": ({1: (400, 819_200), 2: (400, 409_600), 4: (400, 204_800)}, "r" * 9 + "a"),
    "granite-4.0-h-small": ({1: (528, 2_162_688), 2: (528, 1_081_344), 8: (528, 270_336)}, "r" * 9 + "a"),
    # every layer parallel: 36 attention and 36 Mamba-2 caches, two groups of 36, attention first
    "falcon-h1-0.5b": ({1: (800, 409_600), 2: (800, 204_800), 8: (208, 53_248)}, "ar"),
    # Mamba-1 state (inner x 16 per rank) plus its conv: 80-token blocks at every TP size; 4 attention layers
    # and 28 Mamba-1: seven Mamba groups of four, one attention group
    "jamba-v0.1": ({1: (80, 327_680), 2: (80, 163_840), 8: (80, 40_960)}, "r" * 7 + "a"),
}


@pytest.mark.parametrize("name,tp", [(n, tp) for n in sorted(CASES) for tp in EXPECTED[n][0]])
def test_vllm_planner_layout_equals_the_preset(model_configs, name, tp):
    case = CASES[name]
    got = layout_from_kv_cache_config(_kv_cache_config(case, model_configs(name), tp), case.cfg.name, tp)
    want = preset_layout(name, tp)
    sizes, kinds = EXPECTED[name]
    assert {(g.block_tokens, g.page_bytes) for g in got.groups} == {sizes[tp]}
    assert "".join(g.kind[0] for g in got.groups) == kinds
    assert got.signature() == want.signature()
    check_matches_preset(got, name)
    cached = {layer_index(n) for g in got.groups for n in g.layer_names}
    assert cached == {i for i, _ in case.cfg.cache_layers()}  # the MLP / MoE layers keep nothing
    assert got.fingerprint() == want.fingerprint()


def test_a_tp_size_the_model_cannot_split_is_refused():
    with pytest.raises(LayoutError, match="granite-4.0-h-tiny: 12 attention heads .* tp=8"):
        preset_layout("granite-4.0-h-tiny", 8)
