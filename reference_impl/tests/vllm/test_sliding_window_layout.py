"""Sliding-window models at their real sizes through vLLM's own planner: Gemma 3 27B (62 layers, five sliding-window
layers of 1024 tokens to one global, 16 KV heads of 128) and gpt-oss-120b (36 layers alternating a 128-token
window and full attention, 8 KV heads of 64), their configs written by transformers, their layers' specs as vLLM's
attention layers report them on FlashAttention. The layout the connector derives from vLLM's KVCacheConfig equals
hybridkv's preset group by group (kinds, windows, which layers share a group, pages, blocks), so a preset client
shares the connector's namespace; and without vLLM's hybrid manager every layer is cached as full attention."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.vllm.layout_from_vllm import check_matches_preset, layout_from_kv_cache_config
from hybridkv.model.keys import namespace
from hybridkv.model.layout import layer_index
from hybridkv.model.presets import preset_layout
from hybridkv.model.presets.sliding import PRESETS as SLIDING_CONFIGS
from hybridkv_bench import vllm_planning as planning

NUM_BLOCKS = 4096  # enough for one 4096-token request in every group


@pytest.fixture(scope="module")
def models(model_dir):
    from transformers import Gemma3TextConfig, GptOssConfig

    g = SLIDING_CONFIGS["gemma-3-27b"]
    gemma = Gemma3TextConfig(
        num_hidden_layers=g.num_layers, hidden_size=g.hidden_size, intermediate_size=21504,
        num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_kv_heads, head_dim=g.head_dim,
        sliding_window=g.sliding_window, query_pre_attn_scalar=168, vocab_size=262208)
    assert gemma.layer_types == ["sliding_attention" if c == "S" else "full_attention" for c in g.pattern]
    gemma.architectures = ["Gemma3ForCausalLM"]
    gemma.save_pretrained(model_dir / "gemma-3-27b")
    oss = GptOssConfig()  # transformers' defaults are gpt-oss-120b's
    o = SLIDING_CONFIGS["gpt-oss-120b"]
    assert (oss.num_hidden_layers, oss.sliding_window, oss.num_key_value_heads, oss.head_dim) == (
        o.num_layers, o.sliding_window, o.num_kv_heads, o.head_dim)
    assert oss.layer_types == ["sliding_attention" if c == "S" else "full_attention" for c in o.pattern]
    oss.architectures = ["GptOssForCausalLM"]
    oss.save_pretrained(model_dir / "gpt-oss-120b")
    return {name: planning.model_config(model_dir / name, max_model_len=4096)
            for name in ("gemma-3-27b", "gpt-oss-120b")}


def _layout(models, name: str, tp: int, disable_hma: bool = False):
    vc = planning.vllm_config(models[name], planning.TINY_SLIDING, tp=tp)
    if disable_hma:
        vc.scheduler_config.disable_hybrid_kv_cache_manager = True
    kv_cache_config, _ = planning.plan_kv_cache(vc, num_blocks=NUM_BLOCKS)
    return layout_from_kv_cache_config(kv_cache_config, preset_layout(name, tp).model, tp)


@pytest.mark.parametrize("name,tp,groups,page", [("gemma-3-27b", 1, 6, 131_072), ("gemma-3-27b", 2, 6, 65_536),
                                                 ("gpt-oss-120b", 1, 1, 32_768), ("gpt-oss-120b", 2, 1, 16_384)])
def test_vllm_planner_layout_equals_the_sliding_preset(models, name, tp, groups, page):
    got, want = _layout(models, name, tp), preset_layout(name, tp)
    cfg = SLIDING_CONFIGS[name]
    assert got.signature() == want.signature()  # kind, layer indices, page, block, dtype and the window
    check_matches_preset(got, name)
    assert [g.kind for g in got.groups] == ["sliding"] * groups + ["attention"]
    assert {(g.block_tokens, g.page_bytes) for g in got.groups} == {(16, page)}
    assert {g.window for g in got.groups if g.kind == "sliding"} == {cfg.sliding_window}
    # vLLM's grouping: the full-attention layers together; sliding layer k of every group-sized run in group k
    cached = sorted(layer_index(n) for g in got.groups for n in g.layer_names)
    assert cached == list(range(cfg.num_layers))
    for g in got.groups:
        assert all(cfg.pattern[layer_index(n)] == ("S" if g.kind == "sliding" else "F") for n in g.layer_names)
    assert got.fingerprint() == want.fingerprint()
    assert namespace(got, tp - 1, 16) == namespace(want, tp - 1, 16)


def test_objects_hold_the_blocks_a_window_can_need(models):
    gemma, oss = _layout(models, "gemma-3-27b", 1), _layout(models, "gpt-oss-120b", 1)
    # vLLM's unified block (16 tokens) is the default chunk: one block per object, every one of them needed by
    # some resume, so a store writes what full attention would; a resume loads the window's 64 blocks of each
    # sliding group instead of every block
    assert gemma.default_chunk_tokens() == oss.default_chunk_tokens() == 16
    assert all(g.tail_blocks(16) == 1 for g in gemma.groups + oss.groups)
    # chunks of 256 tokens: gpt-oss's 128-token window needs a chunk's last ceil(127 / 16) = 8 of 16 blocks;
    # Gemma's 1024-token window all 16
    assert [g.tail_blocks(256) for g in oss.groups] == [8, 16]
    assert [g.tail_blocks(256) for g in gemma.groups] == [16] * 7
    assert oss.object_bytes(0, 256) == 18 * 8 * 32_768 and oss.object_bytes(1, 256) == 18 * 16 * 32_768
    # a resume at 4096 tokens reads Gemma's sliding objects of the last 1023 tokens' chunks only
    assert {g.window_start_chunk(4096 // 256, 256) for g in gemma.groups if g.kind == "sliding"} == {12}


@pytest.mark.parametrize("name", ["gemma-3-27b", "gpt-oss-120b"])
def test_without_the_hybrid_manager_every_layer_is_cached_as_full_attention(models, name):
    """--disable-hybrid-kv-cache-manager (or a connector without SupportsHMA): vLLM turns the sliding layers' specs
    into FullAttentionSpecs with a window and keeps all their blocks; the connector caches them all."""
    got = _layout(models, name, 1, disable_hma=True)
    assert {g.kind for g in got.groups} == {"attention"}
    assert sorted(layer_index(n) for g in got.groups for n in g.layer_names) == list(
        range(SLIDING_CONFIGS[name].num_layers))
