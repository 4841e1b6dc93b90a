"""The Mamba-1 hybrid family (Jamba): its layouts, for a client or the connector's preset check."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.model.layout import DTYPE_BYTES, LayoutError, ModelLayout
from hybridkv.model.presets.aligned import check_config, check_heads, hybrid_layout


@dataclass(frozen=True, slots=True)
class Mamba1HybridConfig:
    """The fields of a Mamba-1 hybrid config (Jamba) that decide the KV-cache layout: attention every
    `attn_layer_period` layers from `attn_layer_offset`, Mamba-1 elsewhere (its MoE layers change no cache)."""

    name: str
    num_layers: int
    attn_layer_period: int
    attn_layer_offset: int
    num_kv_heads: int
    head_dim: int
    mamba_intermediate: int  # mamba_expand x hidden_size
    ssm_state_size: int
    conv_kernel: int
    num_attention_heads: int = 0
    hidden_size: int = 0
    kv_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "bfloat16"  # vLLM's Mamba-1 SSM cache: the model dtype unless --mamba-ssm-cache-dtype says
    active_params: float = 0.0

    def __post_init__(self) -> None:
        check_config(self, ("num_layers", "attn_layer_period", "num_kv_heads", "head_dim", "mamba_intermediate",
                             "ssm_state_size", "conv_kernel"))
        if not 0 <= self.attn_layer_offset < min(self.attn_layer_period, self.num_layers):
            raise LayoutError(f"{self.name}: attn_layer_offset must be in 0..attn_layer_period-1, "
                              f"got {self.attn_layer_offset}")

    def layer_kinds(self) -> list[str]:
        return ["attention" if i % self.attn_layer_period == self.attn_layer_offset else "recurrent"
                for i in range(self.num_layers)]

    def cache_layers(self) -> list[tuple[int, str]]:
        return list(enumerate(self.layer_kinds()))

    def check_tp(self, tp: int) -> None:
        check_heads(self, tp)
        if self.mamba_intermediate % tp:
            raise LayoutError(f"{self.name}: the Mamba inner size ({self.mamba_intermediate}) does not split over "
                              f"tp={tp}")

    def attn_page_per_token(self, tp: int) -> int:
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def recurrent_state_bytes(self, tp: int) -> tuple[int, int]:
        """(conv state, SSM state) bytes of one Mamba-1 layer on one rank, as vLLM shapes them: conv
        (kernel - 1, inner / tp), SSM (inner / tp, state)."""
        inner = self.mamba_intermediate // tp
        return ((self.conv_kernel - 1) * inner * DTYPE_BYTES[self.conv_dtype],
                inner * self.ssm_state_size * DTYPE_BYTES[self.ssm_dtype])

    def layout(self, tp: int = 1) -> ModelLayout:
        """The layout of one tensor-parallel rank, with vLLM's alignment and grouping rules."""
        return hybrid_layout(self, tp)


# Jamba-v0.1 (AI21): 32 layers, attention at layer 4 of every 8 (1:7), Mamba-1 elsewhere (MoE every other
# layer: no cache), hidden 4096, 32 query / 8 KV heads (of 128), Mamba inner 2 x 4096, state 16, conv kernel 4:
# its config.json (huggingface.co/ai21labs/Jamba-v0.1, config.json), which transformers' JambaConfig defaults
# equal (its docstring names ai21labs/Jamba-v0.1). Jamba 1.5 Mini: no config found, no preset.
JAMBA_V0_1 = Mamba1HybridConfig(
    name="ai21labs/Jamba-v0.1", num_layers=32, attn_layer_period=8, attn_layer_offset=4, num_kv_heads=8,
    head_dim=128, num_attention_heads=32, hidden_size=4096, mamba_intermediate=8192, ssm_state_size=16,
    conv_kernel=4, active_params=12e9,
)
PRESETS: dict[str, Mamba1HybridConfig] = {"jamba-v0.1": JAMBA_V0_1}
