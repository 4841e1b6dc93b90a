"""vLLM's own KV-cache planner on the real model shapes: the layout the connector derives from its KVCacheConfig
equals hybridkv's presets (group order, which layers share a group, block tokens, page bytes), so a client built
from a preset and the connector share one namespace."""

from __future__ import annotations

import pytest

# "vllm.config", not "vllm": without vLLM, this folder would import as a namespace package named vllm
pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
import torch
from hybridkv.engine.vllm.layout_from_vllm import check_matches_preset, layout_from_kv_cache_config
from hybridkv.keys import namespace
from hybridkv.layout import LayoutError, layer_index
from hybridkv.presets import preset_layout
from hybridkv_bench import vllm_offline as offline
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)


@pytest.fixture(scope="module")
def qwen_models(model_dir):
    return {name: offline.model_config(offline.write_config(offline.SHAPES[name], model_dir / name), max_model_len=4096)
            for name in ("qwen3.6-27b", "qwen3-next-80b-a3b")}


@pytest.mark.parametrize("name,tp,block", [("qwen3.6-27b", 1, 784), ("qwen3.6-27b", 8, 400),
                                           ("qwen3-next-80b-a3b", 1, 544)])
def test_vllm_planner_layout_equals_preset(qwen_models, name, tp, block):
    vc = offline.vllm_config(qwen_models[name], offline.SHAPES[name], tp=tp)
    kv_cache_config, _ = offline.plan_kv_cache(vc, num_blocks=64)
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
    interval = offline.SHAPES[name].full_attention_interval
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
    vc = offline.vllm_config(qwen_models["qwen3-next-80b-a3b"], offline.SHAPES["qwen3-next-80b-a3b"])
    kv_cache_config, _ = offline.plan_kv_cache(vc, num_blocks=64)
    got = layout_from_kv_cache_config(kv_cache_config, "next", 1)
    with pytest.raises(LayoutError, match="qwen3.6-27b"):
        check_matches_preset(got, "qwen3.6-27b")


@pytest.mark.parametrize("spec,says", [
    (lambda: SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=512),
     r"group 1 \(model.layers.1.self_attn.attn, model.layers.3.self_attn.attn\) is sliding-window attention "
     r"\(SlidingWindowSpec, window 512 tokens\)"),
    (lambda: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=512),
     r"is sliding-window attention \(FullAttentionSpec, window 512"),  # as --disable-hybrid-kv-cache-manager makes it
    (lambda: ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                                       attention_chunk_size=8192), r"is chunked local attention .*chunks of 8192"),
])
def test_groups_it_cannot_cache_are_refused_naming_them(spec, says):
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"], full),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"], spec())]
    with pytest.raises(LayoutError, match=says + r".*not supported yet"):
        layout_from_kv_cache_config(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), "m", 1)
