"""The sliding-window family (Gemma 3, gpt-oss): full and sliding-window attention layers, no recurrent state, nothing
to align to. Every page is one attention layer's, the block is FlashAttention's 16 tokens, and sliding and full layers
split into groups by vLLM's rule (`hybridkv.model.layout.vllm_groups`); `tests/vllm/test_sliding_window_layout.py`
holds vLLM's planner to these presets."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.model.layout import DTYPE_BYTES, GroupLayout, LayoutError, ModelLayout, vllm_groups


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

    def layout(self, tp: int = 1) -> ModelLayout:
        return sliding_window_layout(self, tp)


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
# Three sliding layers (a window of 100 tokens) and a full one, pages of 2 KiB: the CPU tests of vLLM's planner.
TINY_SLIDING = SlidingWindowConfig(
    name="hybridkv/tiny-sliding", pattern="SSSF", num_kv_heads=2, head_dim=16, sliding_window=100,
    num_attention_heads=4, hidden_size=256,
)
PRESETS: dict[str, SlidingWindowConfig] = {"gemma-3-27b": GEMMA3_27B, "gpt-oss-120b": GPT_OSS_120B,
                                           "tiny-sliding": TINY_SLIDING}
