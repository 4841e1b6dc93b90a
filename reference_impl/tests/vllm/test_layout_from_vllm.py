"""vLLM's own KV-cache planner on the real model shapes: the layout the connector derives from its KVCacheConfig
equals hybridkv's presets (group order, which layers share a group, block tokens, page bytes), so a client built
from a preset and the connector share one namespace."""

from __future__ import annotations

import pytest

# "vllm.config", not "vllm": without vLLM, this folder would import as a namespace package named vllm
pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
import torch
from hybridkv.engine.vllm.layout_from_vllm import check_matches_preset, layout_from_kv_cache_config
from hybridkv.model.keys import namespace
from hybridkv.model.layout import LayoutError, layer_index
from hybridkv.model.presets import model_config, preset_layout
from hybridkv_bench import vllm_planning as planning
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)


@pytest.fixture(scope="module")
def qwen_models(model_dir):
    return {name: planning.model_config(planning.write_config(model_config(name), model_dir / name),
                                        max_model_len=4096)
            for name in ("qwen3.6-27b", "qwen3-next-80b-a3b")}


@pytest.mark.parametrize("name,tp,block", [("qwen3.6-27b", 1, 784), ("qwen3.6-27b", 8, 400),
                                           ("qwen3-next-80b-a3b", 1, 544)])
def test_vllm_planner_layout_equals_preset(qwen_models, name, tp, block):
    vc = planning.vllm_config(qwen_models[name], model_config(name), tp=tp)
    kv_cache_config, _ = planning.plan_kv_cache(vc, num_blocks=64)
    want = preset_layout(name, tp)
    got = layout_from_kv_cache_config(kv_cache_config, want.model, tp)
    assert {g.block_tokens for g in got.groups} == {block}
    assert got.signature() == want.signature()  # group by group: kind, layer indices, page, block, dtype
    assert len(got.groups) == 4 and [g.kind for g in got.groups].count("attention") == 1
    check_matches_preset(got, name)
    # one identity: under the same model id, vLLM's layout (its own layer names) and the preset's share keys
    assert got.groups[0].layer_names[0] == "model.layers.0.linear_attn" != want.groups[0].layer_names[0]
    assert got.fingerprint() == want.fingerprint()
    assert namespace(got, tp - 1, block) == namespace(want, tp - 1, block)
    # vLLM's grouping: attention layers together, and GDN layer k of every attention period in one group
    interval = model_config(name).full_attention_interval
    for g in got.groups:
        idx = [layer_index(n) for n in g.layer_names]
        if g.kind == "attention":
            assert all(i % interval == interval - 1 for i in idx)
        else:
            assert len({i % interval for i in idx}) == 1 and idx == sorted(idx)
    # the connector's objects are the preset's: same bytes per (chunk, group) object, same chunk
    assert got.default_chunk_tokens() == want.default_chunk_tokens() == block
    assert got.chunk_bytes(block) == want.chunk_bytes(block)


def test_a_different_model_is_refused(qwen_models):
    vc = planning.vllm_config(qwen_models["qwen3-next-80b-a3b"], model_config("qwen3-next-80b-a3b"))
    kv_cache_config, _ = planning.plan_kv_cache(vc, num_blocks=64)
    got = layout_from_kv_cache_config(kv_cache_config, "next", 1)
    with pytest.raises(LayoutError, match="qwen3.6-27b"):
        check_matches_preset(got, "qwen3.6-27b")


@pytest.mark.parametrize("spec,says", [
    (lambda: ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                                       attention_chunk_size=8192),
     r"group 1 \(model.layers.1.self_attn.attn, model.layers.3.self_attn.attn\) is chunked local attention "
     r"\(ChunkedLocalAttentionSpec, chunks of 8192 tokens\)"),
    (lambda: MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
     r"is multi-head latent attention \(MLAAttentionSpec\)"),
    (lambda: SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                  sliding_window=128),  # DeepSeek V4's: not a plain sliding window
     r"is multi-head latent attention \(SlidingWindowMLASpec, window 128 tokens\)"),
])
def test_groups_it_cannot_cache_are_refused_naming_them(spec, says):
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"], full),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"], spec())]
    with pytest.raises(LayoutError, match=says + r".*not supported yet"):
        layout_from_kv_cache_config(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), "m", 1)


def test_sliding_window_groups_are_cached_with_their_window():
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], SlidingWindowSpec(
                  block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=512)),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SlidingWindowSpec(
                  block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=512,
                  extra_retained_tokens=3)),  # what vLLM keeps below the window under multi-token speculation
              KVCacheGroupSpec(["model.layers.2.self_attn.attn"], full),
              # a window on a full-attention spec is vLLM without its hybrid manager: it keeps every block
              KVCacheGroupSpec(["model.layers.3.self_attn.attn"], FullAttentionSpec(
                  block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=512))]
    got = layout_from_kv_cache_config(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), "m", 1)
    assert [(g.kind, g.window) for g in got.groups] == [("sliding", 512), ("sliding", 515), ("attention", 0),
                                                        ("attention", 0)]
