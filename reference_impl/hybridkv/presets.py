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

from dataclasses import dataclass, replace
from math import ceil

from hybridkv.layout import DTYPE_BYTES, GroupLayout, LayoutError, ModelLayout, vllm_groups
from hybridkv.sliding_presets import SLIDING_CONFIGS, sliding_window_layout


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


def _check_heads(cfg, tp: int) -> None:
    """vLLM splits the attention heads over the ranks: a TP size that does not divide them is refused."""
    if cfg.num_attention_heads and cfg.num_attention_heads % tp:
        raise LayoutError(f"{cfg.name}: {cfg.num_attention_heads} attention heads do not split over tp={tp}")


def _mamba2_groups(n_groups: int, tp: int) -> int:
    """vLLM's Mamba-2 group count per rank x tp: groups that do not split over the ranks are replicated, one per
    rank (`MambaStateShapeCalculator.extra_groups_for_head_shards`)."""
    return n_groups if n_groups % tp == 0 else tp


@dataclass(frozen=True, slots=True)
class Mamba2HybridConfig:
    """The fields of a Mamba-2 hybrid config (Nemotron-H, Granite-4.0-H, Falcon-H1) that decide the KV-cache
    layout. `pattern` holds one character per decoder layer, as Nemotron-H's `hybrid_override_pattern`: `M`
    Mamba-2, `*` attention, `-` MLP and `E` MoE (the last two keep no cache), and `H` a parallel hybrid layer
    (Falcon-H1: attention and Mamba-2 side by side in every layer). The Mamba-2 inner size is heads x head_dim
    (vLLM's Nemotron-H; Granite's expand x hidden and Falcon-H1's mamba_d_ssm equal it in every preset here)."""

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
    ssm_dtype: str = "float32"  # the SSM cache's dtype under `vllm serve` (Nemotron-H's mamba_ssm_cache_dtype)
    active_params: float = 0.0

    def __post_init__(self) -> None:
        p = self.pattern
        if not p or set(p) - set("M*-EH") or not set(p) & set("MH") or not set(p) & set("*H"):
            raise LayoutError(f"{self.name}: pattern must hold Mamba-2 (M) and attention (*) layers, or parallel "
                              f"hybrid ones (H), among - and E, got {self.pattern!r}")
        _check_config(self, ("num_kv_heads", "head_dim", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                             "n_groups", "conv_kernel"))

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def layer_kinds(self) -> list[str | None]:
        return [{"M": "recurrent", "*": "attention", "H": "parallel"}.get(c) for c in self.pattern]

    def cache_layers(self) -> list[tuple[int, str]]:
        """(decoder-layer index, kind) of each layer that keeps a cache, in vLLM's registration order. A parallel
        layer i registers its attention first, then its Mamba-2 mixer under index num_layers + i (vLLM's
        FalconH1ParallelHybrid: "all attention/ssm layers must have different index in prefix")."""
        out: list[tuple[int, str]] = []
        for i, c in enumerate(self.pattern):
            if c == "M":
                out.append((i, "recurrent"))
            elif c == "*":
                out.append((i, "attention"))
            elif c == "H":
                out += [(i, "attention"), (self.num_layers + i, "recurrent")]
        return out

    def check_tp(self, tp: int) -> None:
        _check_heads(self, tp)
        if self.mamba_num_heads % tp or (self.n_groups % tp and self.n_groups != 1):
            raise LayoutError(f"{self.name}: Mamba-2 heads ({self.mamba_num_heads}) or groups ({self.n_groups}) do "
                              f"not split over tp={tp}")

    def attn_page_per_token(self, tp: int) -> int:
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def recurrent_state_bytes(self, tp: int) -> tuple[int, int]:
        """(conv state, SSM state) bytes of one Mamba-2 layer on one rank, as vLLM shapes them: conv
        (kernel - 1, (heads x head_dim + 2 x groups x state) / tp), SSM (heads / tp, head_dim, state); a group
        count the ranks do not divide is replicated to one per rank first."""
        groups = _mamba2_groups(self.n_groups, tp)
        conv_dim = (self.mamba_num_heads * self.mamba_head_dim + 2 * groups * self.ssm_state_size) // tp
        conv = (self.conv_kernel - 1) * conv_dim * DTYPE_BYTES[self.conv_dtype]
        ssm = self.mamba_num_heads // tp * self.mamba_head_dim * self.ssm_state_size * DTYPE_BYTES[self.ssm_dtype]
        return conv, ssm


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
        _check_config(self, ("num_layers", "attn_layer_period", "num_kv_heads", "head_dim", "mamba_intermediate",
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
        _check_heads(self, tp)
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


HybridConfig = HybridModelConfig | Mamba2HybridConfig | Mamba1HybridConfig


def hybrid_layout(cfg: HybridConfig, tp: int = 1, align: int = 16) -> ModelLayout:
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
    ) for kind, idxs in vllm_groups(cfg.cache_layers()))
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


# Mamba hybrids: their layouts (a client or the connector's preset check); the harness's scenarios model the
# Qwen-style configs above only. Each preset's source is beside it; what could not be cited has no preset.
# Nemotron-H-8B (nvidia/Nemotron-H-8B-Base-8K): 52 layers in the pattern below (24 Mamba-2, 4 attention,
# 24 MLP), hidden 4096, 32 query / 8 KV heads of 128, 128 Mamba heads of 64 with state 128 (NVIDIA's
# Megatron-Bridge model page, "Nemotron H 8B Specifications"); 8 groups, conv kernel 4 and an fp32 SSM cache
# are transformers' NemotronHConfig defaults, which describe this model.
NEMOTRON_H_8B = Mamba2HybridConfig(
    name="nvidia/Nemotron-H-8B-Base-8K", pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    num_kv_heads=8, head_dim=128, num_attention_heads=32, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, active_params=8e9,
)

# Granite-4.0-H (IBM): 40 layers, 4 attention and 36 Mamba-2, an MLP or MoE inside every layer (no cache). The
# sizes are IBM's model card table ("Model Architecture", the same in every Granite 4.0 card; read in a copy of
# the H-Tiny card: github.com/DocDBrown/IBMGranite4Tiny README.md): embedding, layers, attention head size,
# attention and KV heads, Mamba2 state size and heads. Mamba-2 head size 64, 1 group, conv kernel 4 and the
# attention layers at 5, 15, 25, 35 are the released configs' (mamba_d_head, mamba_n_groups, mamba_d_conv,
# layer_types): H-Micro in a re-upload of its config.json (huggingface.co/anuj6316/granite, config.json),
# H-Tiny in its FP8 copy's (huggingface.co/inference-optimization/granite-4.0-h-tiny-FP8-dynamic, config.json),
# H-Small in IBM's own GGUF metadata (ollama.com/ibm/granite4:small-h: ssm.inner_size 8192 = 128 heads x 64,
# ssm.group_count 1, ssm.conv_kernel 4); H-Small's layer_types were not seen: the family's arrangement is assumed.
# No mamba_ssm_cache_dtype in these configs: vLLM keeps the SSM state in the model dtype.
_GRANITE_4_H_PATTERN = "MMMMM*MMMMMMMMM*MMMMMMMMM*MMMMMMMMM*MMMM"
GRANITE_4_H_MICRO = Mamba2HybridConfig(
    name="ibm-granite/granite-4.0-h-micro", pattern=_GRANITE_4_H_PATTERN, num_kv_heads=8, head_dim=64,
    num_attention_heads=32, hidden_size=2048, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
    conv_kernel=4, ssm_dtype="bfloat16", active_params=3e9,
)
GRANITE_4_H_TINY = Mamba2HybridConfig(
    name="ibm-granite/granite-4.0-h-tiny", pattern=_GRANITE_4_H_PATTERN, num_kv_heads=4, head_dim=128,
    num_attention_heads=12, hidden_size=1536, mamba_num_heads=48, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
    conv_kernel=4, ssm_dtype="bfloat16", active_params=1e9,
)
GRANITE_4_H_SMALL = Mamba2HybridConfig(
    name="ibm-granite/granite-4.0-h-small", pattern=_GRANITE_4_H_PATTERN, num_kv_heads=8, head_dim=128,
    num_attention_heads=32, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128,
    n_groups=1, conv_kernel=4, ssm_dtype="bfloat16", active_params=9e9,
)
# Falcon-H1-0.5B (TII): 36 parallel hybrid layers (attention and Mamba-2 in every one), hidden 1024, 8 query / 2 KV
# heads of 64, 24 Mamba heads of 64, state 128 (transformers' FalconH1 model doc table,
# github.com/huggingface/transformers docs/source/en/model_doc/falcon_h1.md); 1 group, conv kernel 4 and
# mamba_d_ssm 1536 = 24 x 64 are in the config.json of a fine-tune of it with the same shapes
# (huggingface.co/MerlinSafety/HybridIntelligence-0.5B). The larger Falcon-H1 models (1.5B to 34B) are in the
# same table, but no config of theirs giving mamba_n_groups was found: no presets for them.
FALCON_H1_0_5B = Mamba2HybridConfig(
    name="tiiuae/Falcon-H1-0.5B-Instruct", pattern="H" * 36, num_kv_heads=2, head_dim=64, num_attention_heads=8,
    hidden_size=1024, mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=128, n_groups=1, conv_kernel=4,
    ssm_dtype="bfloat16", active_params=0.5e9,
)
MAMBA2_CONFIGS: dict[str, Mamba2HybridConfig] = {
    "nemotron-h-8b": NEMOTRON_H_8B,
    "granite-4.0-h-micro": GRANITE_4_H_MICRO,
    "granite-4.0-h-tiny": GRANITE_4_H_TINY,
    "granite-4.0-h-small": GRANITE_4_H_SMALL,
    "falcon-h1-0.5b": FALCON_H1_0_5B,
}
# Jamba-v0.1 (AI21): 32 layers, attention at layer 4 of every 8 (1:7), Mamba-1 elsewhere (MoE every other
# layer: no cache), hidden 4096, 32 query / 8 KV heads (of 128), Mamba inner 2 x 4096, state 16, conv kernel 4:
# its config.json (huggingface.co/ai21labs/Jamba-v0.1, config.json), which transformers' JambaConfig defaults
# equal (its docstring names ai21labs/Jamba-v0.1). Jamba 1.5 Mini: no config found, no preset.
JAMBA_V0_1 = Mamba1HybridConfig(
    name="ai21labs/Jamba-v0.1", num_layers=32, attn_layer_period=8, attn_layer_offset=4, num_kv_heads=8,
    head_dim=128, num_attention_heads=32, hidden_size=4096, mamba_intermediate=8192, ssm_state_size=16,
    conv_kernel=4, active_params=12e9,
)
MAMBA1_CONFIGS: dict[str, Mamba1HybridConfig] = {"jamba-v0.1": JAMBA_V0_1}



def preset_names() -> list[str]:
    """The Qwen-style (Gated DeltaNet) presets, which scenarios can model."""
    return sorted(MODEL_CONFIGS)


def layout_preset_names() -> list[str]:
    """Every preset with a layout: the Gated DeltaNet, Mamba-2, Mamba-1 and sliding-window ones."""
    return sorted([*MODEL_CONFIGS, *MAMBA2_CONFIGS, *MAMBA1_CONFIGS, *SLIDING_CONFIGS])


def model_config(name: str) -> HybridModelConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}") from None


def preset_layout(name: str, tp: int = 1) -> ModelLayout:
    """The layout of preset `name` (Gated DeltaNet, Mamba-2, Mamba-1 or sliding window) on one rank at
    tensor-parallel size `tp`."""
    if name in MAMBA2_CONFIGS:
        return hybrid_layout(MAMBA2_CONFIGS[name], tp)
    if name in MAMBA1_CONFIGS:
        return hybrid_layout(MAMBA1_CONFIGS[name], tp)
    if name in SLIDING_CONFIGS:
        return sliding_window_layout(SLIDING_CONFIGS[name], tp)
    if name not in MODEL_CONFIGS:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(layout_preset_names())}")
    return hybrid_layout(model_config(name), tp)
