"""Our `ModelLayout` derived from vLLM's own `KVCacheConfig`, in vLLM's group order, under the model's identity."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from hybridkv.model.layout import GroupKind, GroupLayout, LayoutError, ModelLayout
from hybridkv.model.model_identity import model_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig, model: str, tp_size: int) -> ModelLayout:
    """One group per vLLM KV-cache group: full attention -> attention, sliding window -> sliding (with vLLM's
    window: its SlidingWindowManager frees the KV of positions < t - window + 1 at t computed tokens, so the
    window here is `sliding_window` plus any tokens vLLM retains below it), Mamba/GDN -> recurrent."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind: GroupKind
        window = 0
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise LayoutError(f"KV-cache group {i} keeps Mamba state in mode {spec.mamba_cache_mode!r}; "
                                  "hybridkv needs --mamba-cache-mode align (a state per block boundary)")
            kind, dtype = "recurrent", "uint8"
        elif type(spec) is FullAttentionSpec and spec.attention_chunk_size is None:
            # A sliding window here is vLLM without its hybrid manager (--disable-hybrid-kv-cache-manager): it
            # keeps every block of such a layer, so every block is cached like full attention's.
            kind, dtype = "attention", str(spec.dtype).removeprefix("torch.")
        elif type(spec) is SlidingWindowSpec:  # not its MLA subclass (DeepSeek V4: a replayed window)
            kind, dtype = "sliding", str(spec.dtype).removeprefix("torch.")
            window = spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
        else:
            layers = ", ".join(g.layer_names[:2]) + (", ..." if len(g.layer_names) > 2 else "")
            raise LayoutError(f"KV-cache group {i} ({layers}) is {group_kind_name(spec)}: hybridkv caches "
                              "full-attention, sliding-window and Mamba/GDN groups only; chunked-local and MLA "
                              "groups (Llama 4, DeepSeek) are not supported yet (hybridkv/engine/vllm/README.md)")
        groups.append(GroupLayout(kind=kind, layer_names=tuple(g.layer_names), page_bytes=spec.page_size_bytes,
                                  block_tokens=spec.block_size, dtype=dtype, window=window))
    return ModelLayout(model=model, groups=tuple(groups), tp_size=tp_size)


def group_kind_name(spec) -> str:
    """What a refused KV-cache group is, in words a user can match to their model."""
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    name = type(spec).__name__
    if "MLA" in name:
        return f"multi-head latent attention ({name}{f', window {window} tokens' if window else ''})"
    if "ChunkedLocal" in name or chunk is not None:
        return f"chunked local attention ({name}, chunks of {chunk} tokens)"
    if "SlidingWindow" in name or window is not None:
        return f"sliding-window attention of a kind hybridkv does not cache ({name}, window {window} tokens)"
    return f"a {name}"


def check_matches_preset(layout: ModelLayout, preset: str) -> None:
    """LayoutError when vLLM's layout is not the hybridkv preset `preset` at the same TP size."""
    from hybridkv.model.presets import preset_layout

    want = preset_layout(preset, layout.tp_size)
    if layout.signature() != want.signature():
        raise LayoutError(f"vLLM's KV-cache layout {layout.signature()} is not hybridkv preset {preset!r} "
                          f"at tp={layout.tp_size}: {want.signature()}")


def vllm_model_identity(vllm_config: VllmConfig) -> str:
    """The served model's identity (`hybridkv.model.model_identity`): its config.json and weights, with the dtypes
    vLLM runs it in, not the path or hub name it was given. A model whose files are not on this host (not a
    folder, not in the Hugging Face cache) is known by that name, as before."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    engine = {"dtype": str(mc.dtype).removeprefix("torch."), "quantization": mc.quantization,
              "cache_dtype": cc.cache_dtype, "mamba_cache_dtype": cc.mamba_cache_dtype,
              "mamba_ssm_cache_dtype": cc.mamba_ssm_cache_dtype,
              "hf_overrides": repr(mc.hf_overrides) if mc.hf_overrides else None}
    folder = model_folder(mc.model, mc.revision)
    if folder is None:
        log.warning("hybridkv: no local config.json for model %r; its chunks are keyed by that name", mc.model)
        return mc.model
    return model_identity(folder, engine, fallback_path=mc.model)


def model_folder(model: str, revision: str | None) -> Path | None:
    """The local folder holding `model`'s config.json: the path itself, or its Hugging Face cache snapshot."""
    if (Path(model) / "config.json").is_file():
        return Path(model)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None
