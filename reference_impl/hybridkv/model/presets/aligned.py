"""vLLM's page alignment for models with recurrent state (Gated DeltaNet, Mamba-2, Mamba-1 hybrids).

vLLM makes every page of a hybrid model the same size. The attention block size is raised to
    block = align * cdiv(mamba_page, align * attn_page_per_token)
(align = 16 for FlashAttention on Hopper), the recurrent page is padded up to block * attn_page_per_token,
and layers are split into groups as vLLM 0.33's planner (`vllm.v1.core.kv_cache_planning`) splits them: one
bucket per layer kind in the order the model first shows it, a group size of the smallest bucket (the largest
when every bucket is under 1.5x the smallest), and group i of a bucket holding its layers i, i+n, i+2n, ... (n
groups): GDN layer i of every attention period. A preset's layout is then vLLM's, up to layer naming, so a
client built from a preset shares the vLLM connector's namespace (`tests/vllm/test_layout_from_vllm.py`).
"""

from __future__ import annotations

from math import ceil
from typing import Protocol

from hybridkv.model.layout import DTYPE_BYTES, GroupLayout, LayoutError, ModelLayout, vllm_groups


class RecurrentHybrid(Protocol):
    """What the alignment rule reads of a family's config."""

    @property
    def name(self) -> str: ...
    @property
    def kv_dtype(self) -> str: ...
    def check_tp(self, tp: int) -> None: ...
    def attn_page_per_token(self, tp: int) -> int: ...
    def recurrent_state_bytes(self, tp: int) -> tuple[int, int]: ...
    def cache_layers(self) -> list[tuple[int, str]]: ...


def check_config(cfg, positive: tuple[str, ...]) -> None:
    """LayoutError naming the config and the field: a size that is not positive, a dtype not known."""
    for f in positive:
        if getattr(cfg, f) <= 0:
            raise LayoutError(f"{cfg.name}: {f} must be positive, got {getattr(cfg, f)}")
    for f in ("kv_dtype", "conv_dtype", "ssm_dtype"):
        if getattr(cfg, f) not in DTYPE_BYTES:
            raise LayoutError(f"{cfg.name}: unknown {f} {getattr(cfg, f)!r}")


def check_heads(cfg, tp: int) -> None:
    """vLLM splits the attention heads over the ranks: a TP size that does not divide them is refused."""
    if cfg.num_attention_heads and cfg.num_attention_heads % tp:
        raise LayoutError(f"{cfg.name}: {cfg.num_attention_heads} attention heads do not split over tp={tp}")


def hybrid_layout(cfg: RecurrentHybrid, tp: int = 1, align: int = 16) -> ModelLayout:
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
