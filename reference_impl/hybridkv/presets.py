"""Model presets: layouts computed from model configs with vLLM's hybrid page-alignment rule.

vLLM makes every page of a hybrid model the same size. The attention block size is raised to
    block = align * cdiv(mamba_page, align * attn_page_per_token)
(align = 16 for FlashAttention on Hopper), the recurrent page is padded up to block * attn_page_per_token,
and layers are split into groups as vLLM 0.33's planner (`vllm.v1.core.kv_cache_planning`) splits them: one
bucket per layer kind in the order the model first shows it, a group size of the smallest bucket (the largest
when every bucket is under 1.5x the smallest), and group i of a bucket holding its layers i, i+n, i+2n, ... (n
groups): GDN layer i of every attention period. A preset's layout is then vLLM's, up to layer naming, so a
client built from a preset shares the vLLM connector's namespace (`tests/vllm/test_layout_from_vllm.py`).

Sliding-window models (Gemma 3, gpt-oss) have no recurrent state to align to: every page is one attention
layer's, the block is FlashAttention's 16 tokens, and sliding and full layers split into groups by the same
rule (`tests/vllm/test_sliding_window_layout.py` holds vLLM's planner to these presets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import ceil

from hybridkv.layout import DTYPE_BYTES, GroupLayout, LayoutError, ModelLayout


def _check_config(cfg, positive: tuple[str, ...]) -> None:
    """LayoutError naming the config and the field: a size that is not positive, a dtype not known."""
    for f in positive:
        if getattr(cfg, f) <= 0:
            raise LayoutError(f"{cfg.name}: {f} must be positive, got {getattr(cfg, f)}")
    for f in ("kv_dtype", "conv_dtype", "ssm_dtype"):
        if getattr(cfg, f) not in DTYPE_BYTES:
            raise LayoutError(f"{cfg.name}: unknown {f} {getattr(cfg, f)!r}")


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
        _check_config(self, ("num_layers", "full_attention_interval", "num_kv_heads", "head_dim",
                             "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim"))

    def layer_kinds(self) -> list[str]:
        return ["attention" if (i + 1) % self.full_attention_interval == 0 else "recurrent"
                for i in range(self.num_layers)]

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


@dataclass(frozen=True, slots=True)
class Mamba2HybridConfig:
    """The fields of a Nemotron-H style config (Mamba-2 state layers among attention, MLP and MoE layers) that
    decide the KV-cache layout. `pattern` is the config's `hybrid_override_pattern`: one character per decoder
    layer, `M` Mamba-2, `*` attention, `-` MLP and `E` MoE (the last two keep no cache)."""

    name: str
    pattern: str
    num_kv_heads: int
    head_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    num_attention_heads: int = 0
    hidden_size: int = 0
    kv_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"  # the config's mamba_ssm_cache_dtype
    active_params: float = 0.0

    def __post_init__(self) -> None:
        if not self.pattern or set(self.pattern) - set("M*-E") or "M" not in self.pattern or "*" not in self.pattern:
            raise LayoutError(f"{self.name}: pattern must hold M (Mamba-2) and * (attention) layers among - and E, "
                              f"got {self.pattern!r}")
        _check_config(self, ("num_kv_heads", "head_dim", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                             "n_groups", "conv_kernel"))

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def layer_kinds(self) -> list[str | None]:
        return [{"M": "recurrent", "*": "attention"}.get(c) for c in self.pattern]

    def check_tp(self, tp: int) -> None:
        if self.mamba_num_heads % tp or self.n_groups % tp:
            raise LayoutError(f"{self.name}: Mamba-2 heads ({self.mamba_num_heads}) or groups ({self.n_groups}) do "
                              f"not split over tp={tp}")

    def attn_page_per_token(self, tp: int) -> int:
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def recurrent_state_bytes(self, tp: int) -> tuple[int, int]:
        """(conv state, SSM state) bytes of one Mamba-2 layer on one rank, as vLLM shapes them: conv
        (kernel - 1, (heads x head_dim + 2 x groups x state) / tp), SSM (heads / tp, head_dim, state)."""
        conv_dim = (self.mamba_num_heads * self.mamba_head_dim + 2 * self.n_groups * self.ssm_state_size) // tp
        conv = (self.conv_kernel - 1) * conv_dim * DTYPE_BYTES[self.conv_dtype]
        ssm = self.mamba_num_heads // tp * self.mamba_head_dim * self.ssm_state_size * DTYPE_BYTES[self.ssm_dtype]
        return conv, ssm


@dataclass(frozen=True, slots=True)
class SlidingWindowConfig:
    """The fields of a Gemma 3 / gpt-oss style config (full and sliding-window attention layers, no recurrent
    state) that decide the KV-cache layout. `pattern` has one character per decoder layer: `S` sliding window,
    `F` full attention (the config's `layer_types`)."""

    name: str
    pattern: str
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    num_attention_heads: int = 0
    hidden_size: int = 0
    kv_dtype: str = "bfloat16"
    block_tokens: int = 16  # FlashAttention's kernel block: vLLM's block when no recurrent page widens it
    active_params: float = 0.0

    def __post_init__(self) -> None:
        if not self.pattern or set(self.pattern) - set("SF") or "S" not in self.pattern:
            raise LayoutError(f"{self.name}: pattern must hold S (sliding-window) layers among F (full attention) "
                              f"ones, got {self.pattern!r}")
        for f in ("num_kv_heads", "head_dim", "sliding_window", "block_tokens"):
            if getattr(self, f) <= 0:
                raise LayoutError(f"{self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise LayoutError(f"{self.name}: unknown kv_dtype {self.kv_dtype!r}")

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def layer_kinds(self) -> list[str]:
        return ["sliding" if c == "S" else "attention" for c in self.pattern]

    def attn_page_per_token(self, tp: int) -> int:
        """K and V bytes of one token in one layer on one rank (kv heads replicated to >= 1)."""
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * DTYPE_BYTES[self.kv_dtype]


def sliding_window_layout(cfg: SlidingWindowConfig, tp: int = 1) -> ModelLayout:
    """The layout of one tensor-parallel rank of a sliding-window model, grouped as vLLM groups it."""
    if tp < 1 or (tp & (tp - 1)):
        raise LayoutError(f"tensor-parallel size must be a power of two, got {tp}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise LayoutError(f"{cfg.name}: {cfg.num_kv_heads} kv heads neither split over nor replicate to tp={tp}")
    page = cfg.block_tokens * cfg.attn_page_per_token(tp)
    groups = tuple(GroupLayout(kind=kind, layer_names=tuple(f"model.layers.{i}" for i in idxs),  # type: ignore[arg-type]
                               page_bytes=page, block_tokens=cfg.block_tokens, dtype=cfg.kv_dtype,
                               window=cfg.sliding_window if kind == "sliding" else 0)
                   for kind, idxs in vllm_groups(cfg.layer_kinds()))
    return ModelLayout(model=cfg.name, groups=groups, tp_size=tp)


def vllm_group_size(layer_counts: list[int]) -> int:
    """Layers per KV-cache group under vLLM's uniform-page-size grouping."""
    lo, hi = min(layer_counts), max(layer_counts)
    return hi if hi < lo * 1.5 else lo


def vllm_groups(layer_kinds: Sequence[str | None]) -> list[tuple[str, list[int]]]:
    """(kind, layer indices) of each KV-cache group, in vLLM's order: buckets by first appearance, each split
    into ceil(len / size) groups, group i taking the bucket's layers i::groups (vLLM pads the last ones).
    Layers of kind None (MLP, MoE) keep no cache and join no group."""
    buckets: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_kinds):
        if kind is not None:
            buckets.setdefault(kind, []).append(i)
    size = vllm_group_size([len(v) for v in buckets.values()])
    out: list[tuple[str, list[int]]] = []
    for kind, idxs in buckets.items():
        n = ceil(len(idxs) / size)
        out.extend((kind, idxs[i::n]) for i in range(n))
    return out


def hybrid_layout(cfg: HybridModelConfig | Mamba2HybridConfig, tp: int = 1, align: int = 16) -> ModelLayout:
    """The layout of one tensor-parallel rank of `cfg`, with vLLM's alignment and grouping rules."""
    if tp < 1 or (tp & (tp - 1)):
        raise LayoutError(f"tensor-parallel size must be a power of two, got {tp}")
    cfg.check_tp(tp)
    attn_tok = cfg.attn_page_per_token(tp)
    conv, ssm = cfg.recurrent_state_bytes(tp)
    mamba_page = conv + ssm
    block = align * ceil(mamba_page / (align * attn_tok))
    page = block * attn_tok
    assert page >= mamba_page
    groups = tuple(GroupLayout(
        kind=kind,  # type: ignore[arg-type]
        layer_names=tuple(f"model.layers.{i}" for i in idxs),
        page_bytes=page,
        block_tokens=block,
        dtype=cfg.kv_dtype if kind == "attention" else "uint8",
    ) for kind, idxs in vllm_groups(cfg.layer_kinds()))
    return ModelLayout(model=cfg.name, groups=groups, tp_size=tp)


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

MODEL_CONFIGS: dict[str, HybridModelConfig] = {
    "qwen3.6-27b": QWEN36_27B,
    "qwen3.5-27b": QWEN35_27B,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B,
    "tiny-hybrid": TINY_HYBRID,
    "qwen3.6-27b-4layers": QWEN36_27B_4L,
}


# Mamba-2 hybrids: their layouts (a client or the connector's preset check); the harness's scenarios model
# the Qwen-style configs above only.
# Nemotron-H-8B (nvidia/Nemotron-H-8B-Base-8K): 52 layers in the pattern below (24 Mamba-2, 4 attention,
# 24 MLP), hidden 4096, 32 query / 8 KV heads of 128, 128 Mamba heads of 64 with state 128 (NVIDIA's
# Megatron-Bridge model page, "Nemotron H 8B Specifications"); 8 groups, conv kernel 4 and an fp32 SSM cache
# are transformers' NemotronHConfig defaults, which describe this model.
NEMOTRON_H_8B = Mamba2HybridConfig(
    name="nvidia/Nemotron-H-8B-Base-8K", pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    num_kv_heads=8, head_dim=128, num_attention_heads=32, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, active_params=8e9,
)
MAMBA2_CONFIGS: dict[str, Mamba2HybridConfig] = {"nemotron-h-8b": NEMOTRON_H_8B}

# Sliding-window models: their layouts (a client or the connector's preset check).
# Gemma 3 27B (google/gemma-3-27b-it's text config): 62 layers, five local (sliding window of 1024 tokens) to
# one global, 32 query / 16 KV heads of 128, hidden 5376.
GEMMA3_27B = SlidingWindowConfig(
    name="google/gemma-3-27b-it", pattern="".join("F" if (i + 1) % 6 == 0 else "S" for i in range(62)),
    num_kv_heads=16, head_dim=128, sliding_window=1024, num_attention_heads=32, hidden_size=5376, active_params=27e9,
)
# gpt-oss-120b (transformers' GptOssConfig defaults): 36 layers alternating sliding (window 128) and full,
# starting with a sliding one; 64 query / 8 KV heads of 64, hidden 2880.
GPT_OSS_120B = SlidingWindowConfig(
    name="openai/gpt-oss-120b", pattern="SF" * 18, num_kv_heads=8, head_dim=64, sliding_window=128,
    num_attention_heads=64, hidden_size=2880, active_params=5.1e9,
)
SLIDING_CONFIGS: dict[str, SlidingWindowConfig] = {"gemma-3-27b": GEMMA3_27B, "gpt-oss-120b": GPT_OSS_120B}


def preset_names() -> list[str]:
    """The Qwen-style (Gated DeltaNet) presets, which scenarios can model."""
    return sorted(MODEL_CONFIGS)


def layout_preset_names() -> list[str]:
    """Every preset with a layout: the Gated DeltaNet, Mamba-2 and sliding-window ones."""
    return sorted([*MODEL_CONFIGS, *MAMBA2_CONFIGS, *SLIDING_CONFIGS])


def model_config(name: str) -> HybridModelConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}") from None


def preset_layout(name: str, tp: int = 1) -> ModelLayout:
    """The layout of preset `name` (Gated DeltaNet, Mamba-2 or sliding window) on one rank at tensor-parallel
    size `tp`."""
    if name in MAMBA2_CONFIGS:
        return hybrid_layout(MAMBA2_CONFIGS[name], tp)
    if name in SLIDING_CONFIGS:
        return sliding_window_layout(SLIDING_CONFIGS[name], tp)
    if name not in MODEL_CONFIGS:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(layout_preset_names())}")
    return hybrid_layout(model_config(name), tp)
