from __future__ import annotations

import pytest
from hybridkv.model.presets import model_config
from hybridkv_bench.prefill import RatePrefill, RooflinePrefill, prefill_flops, prefill_seconds

H200 = RooflinePrefill(device_tflops=790.0, efficiency=0.6)


def test_h200_56k_qwen36_is_about_7_6_seconds():
    """ANCHORS.md: ~3.6e15 FLOP at ~60% of ~790 TFLOP/s ~ 7.6 s for 56k tokens of Qwen3.6-27B."""
    cfg = model_config("qwen3.6-27b")
    assert prefill_flops(cfg, 56_000) == pytest.approx(3.6e15, rel=0.05)
    assert prefill_seconds(H200, cfg, 1, 56_000) == pytest.approx(7.6, rel=0.15)


def test_attention_term_is_the_causal_sum():
    cfg = model_config("tiny-hybrid")
    attn_layers, heads, d = 2, cfg.num_attention_heads, cfg.head_dim
    for cached, new in ((0, 7), (5, 9), (160, 80)):
        brute = sum(4 * attn_layers * heads * d * (p + 1) for p in range(cached, cached + new))
        assert prefill_flops(cfg, new, cached) == pytest.approx(2 * cfg.active_params * new + brute)


def test_a_hit_saves_compute_and_tp_splits_it():
    cfg = model_config("qwen3.6-27b")
    cold = prefill_seconds(H200, cfg, 1, 56_000)
    warm = prefill_seconds(H200, cfg, 1, 336, 55_664)
    assert 0 < warm < cold / 50
    assert prefill_seconds(H200, cfg, 4, 56_000) == pytest.approx(cold / 4)
    assert prefill_seconds(RatePrefill(rate=23_000.0), cfg, 4, 23_000) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        prefill_flops(cfg, -1)
