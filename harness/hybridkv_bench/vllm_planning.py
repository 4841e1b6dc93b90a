"""vLLM 0.33's KV-cache planning for models that are never built: the config fields that decide a KV cache (a
Gated DeltaNet preset, `hybridkv.model.presets.gated_deltanet.HybridModelConfig`, with any overrides: full attention
+ GDN;
a sliding-window preset: Gemma 3-shaped full + sliding-window attention), config.json files written by transformers,
vLLM's ModelConfig and VllmConfig around them, the layers' KV-cache specs as vLLM's layer classes report them, and
vLLM's own planner over those specs. `vllm_offline` runs vLLM's scheduler on the result.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from hybridkv.model import presets
from hybridkv.model.presets.gated_deltanet import HybridModelConfig
from hybridkv.model.presets.sliding import SlidingWindowConfig

from hybridkv_bench.model_shape import transformers_config

if TYPE_CHECKING:
    from hybridkv.model.presets.mamba1 import Mamba1HybridConfig
    from hybridkv.model.presets.mamba2 import Mamba2HybridConfig

# GDN layers of Qwen3.5/3.6 and Qwen3-Next share one state-shape rule; vLLM's Qwen3.5 module also imports a
# vision tower that needs torchvision, which has no CPU build for this torch on PyPI, so the planner reads
# both through Qwen3-Next's class (Qwen3.6's float32 SSM state is passed as mamba_ssm_cache_dtype, as its
# config's mamba_ssm_dtype would set it).
ARCHITECTURE = "Qwen3NextForCausalLM"


# The presets vLLM's planner is asked about in the tests: the tiny hybrid and a tiny Gemma 3-shaped model.
TINY = presets.model_config("tiny-hybrid")
TINY_SLIDING = cast(SlidingWindowConfig, presets.preset("tiny-sliding"))


def write_sliding_config(shape: SlidingWindowConfig, directory: str | Path) -> Path:
    """A local Gemma 3 text model directory holding a config.json written by transformers (nothing downloaded)."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        num_hidden_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, sliding_window=shape.sliding_window, query_pre_attn_scalar=shape.head_dim,
        layer_types=["sliding_attention" if c == "S" else "full_attention" for c in shape.pattern],
        vocab_size=1024, intermediate_size=256, max_position_embeddings=1 << 20)
    cfg.architectures = ["Gemma3ForCausalLM"]
    path = Path(directory)
    cfg.save_pretrained(path)
    return path


def write_config(shape: HybridModelConfig, directory: str | Path, weights_seed: int | None = None,
                 **overrides: Any) -> Path:
    """A local model directory holding a config.json written by transformers (nothing downloaded; `overrides` set
    further config fields) and, with `weights_seed`, a small safetensors file of seeded random weights: what the
    connector's model identity reads (the forward is simulated, so no weight is ever used). A preset without
    attention heads or hidden size plans with 16 and 1024 (neither decides the KV cache)."""
    shape = replace(shape, num_attention_heads=shape.num_attention_heads or 16, hidden_size=shape.hidden_size or 1024)
    cfg = transformers_config(shape, "qwen3_5", vocab_size=1024, intermediate_size=256,
                              max_position_embeddings=1 << 20, **overrides)
    cfg.architectures = [ARCHITECTURE]
    cfg.mamba_ssm_dtype = shape.ssm_dtype
    path = Path(directory)
    cfg.save_pretrained(path)
    if weights_seed is not None:
        from safetensors.numpy import save_file

        rng = np.random.default_rng(weights_seed)
        save_file({"model.embed_tokens.weight": rng.standard_normal((1024, shape.hidden_size), dtype=np.float32)},
                  str(path / "model.safetensors"))
    return path


def model_config(model_dir: str | Path, max_model_len: int = 65536):
    """vLLM's ModelConfig of a local config directory (slow: vLLM inspects the architecture in a subprocess). The
    caller's edge sets VLLM_TARGET_DEVICE=cpu and HF_HUB_OFFLINE=1 (the `vllm` engine kind's `env`)."""
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len)


def vllm_config(mc, shape: HybridModelConfig | Mamba2HybridConfig | Mamba1HybridConfig | SlidingWindowConfig, *,
                tp: int = 1, max_num_batched_tokens: int = 8192, max_num_seqs: int = 8,
                kv_transfer: dict[str, Any] | None = None, retention_interval: int | None = 0, max_loras: int = 0,
                kv_events: dict[str, Any] | None = None):
    """A VllmConfig as `vllm serve` builds it around ModelConfig `mc` (copied), with the hybrid block size aligned
    for FlashAttention. `retention_interval`: vLLM keeps (and offers the connector) a GDN state every that many
    tokens; 0 keeps only the prompt's last boundary and shared-prefix junctions. `max_loras` > 0: as
    `--enable-lora --max-loras N` (the scheduler then batches at most N adapters). `kv_events`: as
    `--kv-events-config` (vLLM then publishes its own and the connector's KV cache events)."""
    from vllm import config as vcfg
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    mc = copy.deepcopy(mc)
    # a sliding-window model keeps no recurrent state: CacheConfig's default SSM dtype
    ssm_dtype = "float32" if isinstance(shape, SlidingWindowConfig) else shape.ssm_dtype
    # prefix caching alone selects the GDN "align" mode, as under `vllm serve --enable-prefix-caching`
    cc = vcfg.CacheConfig(enable_prefix_caching=True, mamba_ssm_cache_dtype=ssm_dtype, block_size=16,
                          prefix_cache_retention_interval=retention_interval)
    sc = vcfg.SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                              max_model_len=mc.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True)
    vc = vcfg.VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                         kv_transfer_config=vcfg.KVTransferConfig(**kv_transfer) if kv_transfer else None,
                         parallel_config=vcfg.ParallelConfig(tensor_parallel_size=tp),
                         lora_config=vcfg.LoRAConfig(max_loras=max_loras) if max_loras else None,
                         kv_events_config=vcfg.KVEventsConfig(**kv_events) if kv_events else None)
    # the SSM dtype asked for, as on a GPU: vLLM's CPU platform makes it float32 where the CPU has AVX-512 BF16
    vc.cache_config.mamba_ssm_cache_dtype = ssm_dtype
    # What update_block_size_for_backend does on a GPU once the layers exist: FlashAttention's kernel
    # alignment (16 tokens), the attention block raised until its page holds a GDN state, the state padded.
    if mc.is_hybrid:
        Platform._align_hybrid_block_size(vc, FlashAttentionBackend)
    return vc


def kv_cache_specs(vc) -> dict[str, Any]:
    """Per-layer KV-cache specs as the model's layers report them on FlashAttention (attention: FullAttentionSpec,
    sliding window: SlidingWindowSpec of the config's window, GDN: MambaSpec)."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM as Model
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    mc, cc = vc.model_config, vc.cache_config
    specs: dict[str, Any] = {}
    for i, kind in enumerate(mc.hf_text_config.layer_types):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                head_size=mc.get_head_size(), dtype=mc.dtype)
        elif kind == "sliding_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                head_size=mc.get_head_size(), dtype=mc.dtype, sliding_window=mc.hf_text_config.sliding_window)
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=Model.get_mamba_state_shape_from_config(vc), dtypes=Model.get_mamba_state_dtype_from_config(vc),
                block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode=cc.mamba_cache_mode)
    return specs


def plan_kv_cache(vc, num_blocks: int):
    """vLLM's planner for one worker with memory for `num_blocks` blocks: (worker config, scheduler config)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    specs = kv_cache_specs(vc)
    resolve_kv_cache_layout(vc, [["LBHNC"]], specs.values())
    groups = get_global_kv_cache_groups(vc, [specs])
    page = max(s.page_size_bytes for s in specs.values())
    layers_per_group = max(len(g.layer_names) for g in groups)
    configs = get_kv_cache_configs(vc, [specs], [num_blocks * page * layers_per_group], groups)
    sched = generate_scheduler_kv_cache_config(configs)
    vc.cache_config.num_gpu_blocks = sched.num_blocks
    return configs[0], sched
