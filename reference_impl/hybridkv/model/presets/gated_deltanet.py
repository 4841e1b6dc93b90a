"""The Gated DeltaNet family (Qwen3.5 / Qwen3.6 / Qwen3-Next): full attention every n-th layer, GDN layers between.
The one family the harness's scenarios model (`hybridkv.model.presets.model_config`); its config is the model shape the
harness's vLLM planning and tiny real models are written from."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.model.layout import DTYPE_BYTES, LayoutError, ModelLayout
from hybridkv.model.presets.aligned import check_config, hybrid_layout


@dataclass(frozen=True, slots=True)
class HybridModelConfig:
    """The fields of a Qwen3.5 / Qwen3-Next style config that decide the KV-cache layout."""

    name: str
    num_layers: int
    full_attention_interval: int  # every n-th layer (1-based n, n, 2n, ...) is full attention
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_attention_heads: int = 0
    hidden_size: int = 0
    kv_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    # parameters active per token, for the roofline prefill model (2 FLOP per parameter per token)
    active_params: float = 0.0

    def __post_init__(self) -> None:
        check_config(self, ("num_layers", "full_attention_interval", "num_kv_heads", "head_dim",
                             "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim"))

    def layer_kinds(self) -> list[str]:
        return ["attention" if (i + 1) % self.full_attention_interval == 0 else "recurrent"
                for i in range(self.num_layers)]

    def cache_layers(self) -> list[tuple[int, str]]:
        """(decoder-layer index, kind) of each layer that keeps a cache, in vLLM's registration order."""
        return list(enumerate(self.layer_kinds()))

    def check_tp(self, tp: int) -> None:
        if self.linear_num_value_heads % tp or self.linear_num_key_heads % tp:
            raise LayoutError(f"{self.name}: linear-attention heads do not split over tp={tp}")

    def attn_page_per_token(self, tp: int) -> int:
        """K and V bytes of one token in one attention layer on one rank (kv heads replicated to >= 1)."""
        kv_heads = max(1, self.num_kv_heads // tp)
        return 2 * kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def recurrent_state_bytes(self, tp: int) -> tuple[int, int]:
        """(conv state, SSM state) bytes of one Gated DeltaNet layer on one rank, as vLLM shapes them."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv_dim = (2 * key_dim + value_dim) // tp
        conv = (self.linear_conv_kernel_dim - 1) * conv_dim * DTYPE_BYTES[self.conv_dtype]
        v_heads = self.linear_num_value_heads // tp
        ssm = v_heads * self.linear_key_head_dim * self.linear_value_head_dim * DTYPE_BYTES[self.ssm_dtype]
        return conv, ssm

    def layout(self, tp: int = 1) -> ModelLayout:
        """The layout of one tensor-parallel rank, with vLLM's alignment and grouping rules."""
        return hybrid_layout(self, tp)


# Qwen3.5-27B and Qwen3.6-27B share these shapes (ANCHORS.md).
QWEN36_27B = HybridModelConfig(
    name="Qwen/Qwen3.6-27B", num_layers=64, full_attention_interval=4, num_kv_heads=4, head_dim=256,
    num_attention_heads=24, hidden_size=5120, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, active_params=27e9,
)
QWEN35_27B = replace(QWEN36_27B, name="Qwen/Qwen3.5-27B")
QWEN3_NEXT_80B = HybridModelConfig(
    name="Qwen/Qwen3-Next-80B-A3B-Instruct", num_layers=48, full_attention_interval=4, num_kv_heads=2,
    head_dim=256, num_attention_heads=16, hidden_size=2048, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, ssm_dtype="bfloat16", active_params=3e9,
)
# Four groups like the Qwen models, pages of a few KiB: CPU tests and the smoke scenario.
TINY_HYBRID = HybridModelConfig(
    name="hybridkv/tiny-hybrid", num_layers=8, full_attention_interval=4, num_kv_heads=2, head_dim=16,
    num_attention_heads=4, hidden_size=64, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, active_params=1e6,
)
# Qwen3.6-27B's page shape with a fraction of its layers: full-size pages at a CPU-friendly chunk size.
QWEN36_27B_4L = replace(QWEN36_27B, name="hybridkv/qwen3.6-27b-4-layers", num_layers=4,
                        active_params=27e9 * 4 / 64)

PRESETS: dict[str, HybridModelConfig] = {
    "qwen3.6-27b": QWEN36_27B,
    "qwen3.5-27b": QWEN35_27B,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B,
    "tiny-hybrid": TINY_HYBRID,
    "qwen3.6-27b-4layers": QWEN36_27B_4L,
}
