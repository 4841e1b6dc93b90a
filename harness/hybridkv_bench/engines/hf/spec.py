"""The `[transformers]` table of a scenario: which real hybrid architecture the `transformers` engine builds.

Decoded strictly with the scenario (no torch, no transformers imported here: `hybridkv list` and scenario
validation stay cheap). The attention and Gated DeltaNet shapes come from the scenario's `[model]` preset,
so the pages the engine moves are exactly the ones `hybridkv.model.presets` describes; this table adds what the
cache layout does not decide (vocabulary, MLP widths, experts, weight dtype, seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
from hybridkv.model.presets.gated_deltanet import HybridModelConfig

from hybridkv_bench.model_shape import Arch

WeightDtype = Literal["float32", "bfloat16"]
Attention = Literal["sdpa", "eager"]
# How a warm request's pages reach the model: `whole` loads every page, then runs the continuation;
# `layerwise` starts the continuation at once, each layer waiting for its own pages (states first).
LoadMode = Literal["whole", "layerwise"]
STATE_DTYPE = "float32"  # transformers' gated-delta-rule state, torch path and fla alike
# Workload kinds whose every warm request keeps at least one uncached token after the hit, so the
# oracle always has continuation logits to compare (see engines.hf.engine's module doc).
HF_WORKLOADS = ("long_doc_qa", "multi_turn")


class TransformersSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A random-initialised transformers model matching the scenario's model preset; nothing is downloaded."""

    arch: Arch = "qwen3_5"        # qwen3_5: Qwen3.5 / Qwen3.6 text model; qwen3_next: Qwen3-Next (MoE)
    dtype: WeightDtype = "float32"
    vocab_size: int = 1024
    intermediate_size: int = 128  # dense MLP (qwen3_5)
    num_experts: int = 4          # qwen3_next only
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    seed: int = 0
    attn_implementation: Attention = "sdpa"
    load: LoadMode = "whole"
    # CPU only: torch threads for the process (0 leaves torch's default). On a shared machine one thread is
    # many times faster than two spinning OpenMP threads fighting other processes.
    cpu_threads: int = 0
    # fp32 bound on |continuation logits - full-prefill logits|; bf16 runs report the difference only
    full_prefill_tolerance: float = 1e-5
    # warm requests: the continuation from the in-memory cache (`forward_alone_s`, warm_pipeline_ratio's divisor) is
    # timed this many times, one before the load and the rest after the warm forward, and the median kept: the eager
    # forward alone varies by tens of percent from call to call for the same tokens
    forward_alone_repeats: int = 3

    def __post_init__(self) -> None:
        for f in ("vocab_size", "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"transformers.{f} must be >= 1, got {getattr(self, f)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"transformers.num_experts_per_tok {self.num_experts_per_tok} exceeds "
                             f"num_experts {self.num_experts}")
        if self.forward_alone_repeats < 1:
            raise ValueError(f"transformers.forward_alone_repeats must be >= 1, got {self.forward_alone_repeats}")
        if self.cpu_threads < 0:
            raise ValueError(f"transformers.cpu_threads must be >= 0, got {self.cpu_threads}")
        if self.seed < 0:
            raise ValueError(f"transformers.seed must be >= 0, got {self.seed}")
        if not 0 < self.full_prefill_tolerance < 1:
            raise ValueError(f"transformers.full_prefill_tolerance must lie in (0, 1), got "
                             f"{self.full_prefill_tolerance}")


def transformers_problem(spec: TransformersSpec, cfg: HybridModelConfig, workload_kinds: Sequence[str]) -> str | None:
    """Why a scenario cannot run on the transformers engine, or None. The layout's dtypes must be the cache's
    own (K/V and conv state in the weights' dtype, SSM state fp32), or the pages would not hold it bit for bit."""
    want = {"kv_dtype": spec.dtype, "conv_dtype": spec.dtype, "ssm_dtype": STATE_DTYPE}
    bad = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if bad:
        return (f"the transformers engine keeps {want} (weights {spec.dtype}); model {cfg.name} says {bad}: "
                "set them in [model.overrides]")
    if cfg.num_attention_heads <= 0 or cfg.hidden_size <= 0:
        return (f"model {cfg.name}: num_attention_heads and hidden_size must be set to build a model, got "
                f"{cfg.num_attention_heads}, {cfg.hidden_size}")
    other = sorted(set(workload_kinds) - set(HF_WORKLOADS))
    if other:
        return f"the transformers engine runs workloads {HF_WORKLOADS}, not {other}"
    return None
