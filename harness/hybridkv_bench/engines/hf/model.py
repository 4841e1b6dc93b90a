"""A real hybrid model from transformers' own classes, random-initialised from a config (nothing downloaded).

The attention and Gated DeltaNet shapes come from a `HybridModelConfig` (a preset plus the scenario's
overrides), so `hybridkv.model.presets.aligned.hybrid_layout` of that config is exactly the page layout of the model's
cache. The dtypes the layout assumes must be the ones transformers keeps: attention K/V and the conv state
in the weights' dtype, the recurrent (SSM) state in float32 (both the torch path and fla return fp32).

Prefill runs in segments that end at every chunk boundary whose recurrent state the store policy keeps
(what vLLM's prefix caching in "align" mode does): the state after those tokens is only visible there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hybridkv.model.presets.gated_deltanet import HybridModelConfig

from hybridkv_bench.engines.hf.spec import TransformersSpec, transformers_problem
from hybridkv_bench.model_shape import transformers_config


class HFModelError(ValueError):
    """A model config the transformers engine cannot build or whose cache would not match its layout."""


def hf_config(spec: TransformersSpec, cfg: HybridModelConfig) -> Any:
    """The transformers config of `cfg`'s shapes for `spec.arch` (layer types as the preset's layer_kinds)."""
    problem = transformers_problem(spec, cfg, ())
    if problem:
        raise HFModelError(problem)
    common: dict[str, Any] = dict(vocab_size=spec.vocab_size, max_position_embeddings=1 << 18,
                                  tie_word_embeddings=False, intermediate_size=spec.intermediate_size)
    if spec.arch == "qwen3_5":
        return transformers_config(cfg, "qwen3_5", **common)
    return transformers_config(cfg, "qwen3_next", num_experts=spec.num_experts,
                               num_experts_per_tok=spec.num_experts_per_tok, decoder_sparse_step=1,
                               moe_intermediate_size=spec.moe_intermediate_size,
                               shared_expert_intermediate_size=spec.moe_intermediate_size, mlp_only_layers=[], **common)


@dataclass(slots=True)
class HFModel:
    """The model, its layer indices by kind, and forward passes over one sequence (batch 1) with a cache."""

    model: Any
    spec: TransformersSpec
    cfg: HybridModelConfig
    device: torch.device
    dtype: torch.dtype

    @property
    def layer_kinds(self) -> list[str]:
        return self.cfg.layer_kinds()

    @property
    def decoder_layers(self) -> Any:
        """The decoder layers by index (what a layer-wise load hooks)."""
        return self.model.model.layers

    def sync(self) -> None:
        """Wait for the model's stream (the current one), not the device: a layer-wise load's copies on their
        own streams keep running while the timed forward waits for them layer by layer."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: Any, keep: int = 1) -> torch.Tensor:
        """Logits (keep, vocab) of the last `keep` positions of `ids` (1-D), continuing `cache` in place."""
        if ids.ndim != 1 or not len(ids):
            raise ValueError(f"forward needs a non-empty 1-D token tensor, got shape {tuple(ids.shape)}")
        out = self.model(input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0]

    def prefill(self, ids: torch.Tensor, cache: Any, start: int, ends: Sequence[int], keep_from: int,
                at_boundary: Callable[[int, Any], None] | None = None,
                queue_at_once: bool = False) -> tuple[torch.Tensor, float]:
        """Run tokens start..ends[-1] of `ids` in segments ending at `ends`; returns the logits of positions
        keep_from..ends[-1]-1 (float32) and the seconds the forwards took. `at_boundary(end, cache)` runs after
        every segment but the last, outside the timed region (it copies states out, or snapshots).
        `queue_at_once`: the first forward is queued behind the stream's work instead of after it (a layer-wise
        warm start, whose layers wait for their pages on the GPU); its time then starts at the call."""
        if not ends or ends[0] <= start or list(ends) != sorted(set(ends)) or ends[-1] > len(ids):
            raise ValueError(f"segment ends {list(ends)} must rise from start {start} to at most {len(ids)}")
        if not start <= keep_from < ends[-1]:
            raise ValueError(f"keep_from {keep_from} outside [{start}, {ends[-1]})")
        logits, seconds, pos = [], 0.0, start
        for i, end in enumerate(ends):
            keep = end - max(pos, keep_from) if end > keep_from else 1
            if not (queue_at_once and i == 0):
                self.sync()
            t0 = time.perf_counter()
            out = self.forward(ids[pos:end], cache, keep)
            self.sync()
            seconds += time.perf_counter() - t0
            if end > keep_from:
                logits.append(out.float())
            if at_boundary is not None and i < len(ends) - 1:
                at_boundary(end, cache)
            pos = end
        return torch.cat(logits), seconds


def build_model(spec: TransformersSpec, cfg: HybridModelConfig, device: torch.device) -> HFModel:
    """Random-initialise the model straight on `device` in `spec.dtype` (seeded; nothing downloaded)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(spec, cfg)
    dtype = getattr(torch, spec.dtype)
    if device.type == "cpu" and spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)  # process-wide: the bench process runs one model
    torch.manual_seed(spec.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec.attn_implementation)
    model.eval()
    return HFModel(model=model, spec=spec, cfg=cfg, device=device, dtype=dtype)
