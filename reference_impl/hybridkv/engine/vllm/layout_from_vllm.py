"""Our `ModelLayout` derived from vLLM's own `KVCacheConfig`, in vLLM's group order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.layout import GroupKind, GroupLayout, LayoutError, ModelLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig, model: str, tp_size: int) -> ModelLayout:
    """One group per vLLM KV-cache group: full attention -> attention, Mamba/GDN -> recurrent."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind: GroupKind
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise LayoutError(f"KV-cache group {i} keeps Mamba state in mode {spec.mamba_cache_mode!r}; "
                                  "hybridkv needs --mamba-cache-mode align (a state per block boundary)")
            kind, dtype = "recurrent", "uint8"
        elif type(spec) is FullAttentionSpec and spec.sliding_window is None and spec.attention_chunk_size is None:
            kind, dtype = "attention", str(spec.dtype).removeprefix("torch.")
        else:
            raise LayoutError(f"KV-cache group {i} has a {type(spec).__name__}; hybridkv caches full attention "
                              "and Mamba/GDN groups only")
        groups.append(GroupLayout(kind=kind, layer_names=tuple(g.layer_names), page_bytes=spec.page_size_bytes,
                                  block_tokens=spec.block_size, dtype=dtype))
    return ModelLayout(model=model, groups=tuple(groups), tp_size=tp_size)


def check_matches_preset(layout: ModelLayout, preset: str) -> None:
    """LayoutError when vLLM's layout is not the hybridkv preset `preset` at the same TP size."""
    from hybridkv.presets import preset_layout

    want = preset_layout(preset, layout.tp_size)
    if layout.signature() != want.signature():
        raise LayoutError(f"vLLM's KV-cache layout {layout.signature()} is not hybridkv preset {preset!r} "
                          f"at tp={layout.tp_size}: {want.signature()}")

