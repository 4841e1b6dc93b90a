"""The prefill-time model: how long the engine would compute what the cache did not supply; the scenario's
`[prefill]` table is one of its two kinds (`PrefillModel`).

Prefill is modeled, never measured, because the harness moves real KV bytes but runs no model.

Roofline (`kind = "roofline"`), for `new` uncached tokens after `cached` tokens of prefix:

    FLOP = 2 * active_params * new                                     (every weight, once per token)
         + 4 * n_attn_layers * n_q_heads * head_dim * sum_{p=cached}^{cached+new-1} (p + 1)
                                                    (causal QK^T and PV: 2 FLOP per multiply-add each,
                                                     query p sees p + 1 keys, cached ones included)
    time = FLOP / tp / (device_tflops * 1e12 * efficiency)

The sum is T(cached + new) - T(cached) with T(n) = n (n + 1) / 2. Gated DeltaNet layers cost about
2 * d_k * d_v FLOP per head per token beyond their weights (under 1% for Qwen3.6-27B) and are left
out, as are embeddings' lookups and communication between TP ranks (the ranks split the FLOPs).
For Qwen3.6-27B, 56,000 tokens: 3.02e15 + 0.61e15 = 3.63e15 FLOP, 7.7 s at 790 TFLOP/s x 0.6.

Rate (`kind = "tokens_per_s"`): time = new / rate, the rate being the whole engine's.
"""

from __future__ import annotations

from hybridkv.model.presets.gated_deltanet import HybridModelConfig

from hybridkv_bench.strict import Strict


class RooflinePrefill(Strict, frozen=True, tag_field="kind", tag="roofline"):
    """Prefill time = FLOPs (as the module's doc counts them) / (device_tflops * efficiency)."""

    device_tflops: float
    efficiency: float

    def __post_init__(self) -> None:
        if not self.device_tflops > 0:
            raise ValueError(f"device_tflops must be positive, got {self.device_tflops}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must lie in (0, 1], got {self.efficiency}")


class RatePrefill(Strict, frozen=True, tag_field="kind", tag="tokens_per_s"):
    """Prefill time = uncached tokens / rate (the whole engine, all TP ranks together)."""

    rate: float

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")


PrefillModel = RooflinePrefill | RatePrefill


def _tri(n: int) -> int:
    return n * (n + 1) // 2


def prefill_flops(cfg: HybridModelConfig, new_tokens: int, cached_tokens: int = 0) -> float:
    """FLOPs to prefill `new_tokens` after `cached_tokens` of cached prefix (whole model, all ranks)."""
    if new_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got new={new_tokens} cached={cached_tokens}")
    attn_layers = sum(1 for k in cfg.layer_kinds() if k == "attention")
    dense = 2.0 * cfg.active_params * new_tokens
    pairs = _tri(cached_tokens + new_tokens) - _tri(cached_tokens)
    attention = 4.0 * attn_layers * cfg.num_attention_heads * cfg.head_dim * pairs
    return dense + attention


def prefill_seconds(model: PrefillModel, cfg: HybridModelConfig, tp: int, new_tokens: int,
                    cached_tokens: int = 0) -> float:
    """Modeled prefill time of `new_tokens` uncached tokens on an engine of `tp` ranks."""
    match model:
        case RooflinePrefill():
            rate = model.device_tflops * 1e12 * model.efficiency
            return prefill_flops(cfg, new_tokens, cached_tokens) / tp / rate
        case RatePrefill():
            return new_tokens / model.rate
    raise TypeError(f"unknown prefill model {model!r}")
