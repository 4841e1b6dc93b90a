"""The harness's one model shape: a Gated DeltaNet preset (`hybridkv.model.presets.gated_deltanet.HybridModelConfig`)
with a scenario's overrides. Everything the harness builds of a model derives from it: the scenario's `[model]` table
(`ModelSpec`: the preset, its tensor-parallel size, the chunk, and `[model.overrides]`, `Overrides`: one optional key
per config field), the config.json vLLM's planner reads (`vllm_planning`), the tiny real models a real vLLM engine runs
(`vllm_real`) and the transformers engine's model (`engines.hf.model`), all through `transformers_config`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from hybridkv.model.layout import ModelLayout
from hybridkv.model.presets import model_config
from hybridkv.model.presets.gated_deltanet import HybridModelConfig

from hybridkv_bench.strict import Strict

# transformers' text configs of the family: Qwen3.5 / Qwen3.6 (dense MLP) and Qwen3-Next (MoE)
Arch = Literal["qwen3_5", "qwen3_next"]


def _overrides_fields() -> list[tuple[str, Any, None]]:
    hints = typing.get_type_hints(HybridModelConfig)
    return [(f.name, hints[f.name] | None, None) for f in dataclasses.fields(HybridModelConfig) if f.name != "name"]


if TYPE_CHECKING:
    class Overrides(Strict, frozen=True, omit_defaults=True):
        """Optional replacements for fields of the preset's HybridModelConfig (None keeps the preset's)."""
else:
    # one optional key per config field, typed as the config types it: a field added to the preset is a key here
    Overrides = msgspec.defstruct(
        "Overrides", _overrides_fields(), bases=(Strict,), module=__name__, frozen=True, omit_defaults=True)
    Overrides.__doc__ = "Optional replacements for fields of the preset's HybridModelConfig (None keeps the preset's)."


def apply(cfg: HybridModelConfig, overrides: Overrides) -> HybridModelConfig:
    """`cfg` with the overrides that are set (raises LayoutError on a bad value)."""
    changes = {k: v for k, v in msgspec.structs.asdict(overrides).items() if v is not None}
    return dataclasses.replace(cfg, **changes)


class ModelSpec(Strict, frozen=True):
    """Which model's cache to move: a preset, its tensor-parallel size, the chunk size."""

    preset: str
    tp: int = 1
    chunk_tokens: int = 0  # 0: the layout's unified block size
    overrides: Overrides = Overrides()

    def config(self) -> HybridModelConfig:
        """The preset's config with the overrides applied (raises LayoutError on a bad preset/value)."""
        return apply(model_config(self.preset), self.overrides)

    def layout(self) -> ModelLayout:
        """The layout of one tensor-parallel rank."""
        return self.config().layout(self.tp)

    def resolved_chunk_tokens(self, layout: ModelLayout | None = None) -> int:
        layout = layout or self.layout()
        return self.chunk_tokens or layout.default_chunk_tokens()


def transformers_config(cfg: HybridModelConfig, arch: Arch, **extra: Any) -> Any:
    """The transformers text config of `arch` whose attention and Gated DeltaNet shapes are `cfg`'s (layer types as
    its layer_kinds); `extra` sets what the cache layout does not decide (vocabulary, MLP widths, experts, ...)."""
    fields: dict[str, Any] = dict(
        num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        layer_types=["full_attention" if k == "attention" else "linear_attention" for k in cfg.layer_kinds()])
    if arch == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**fields, **extra)
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    return Qwen3NextConfig(**fields, **extra)
