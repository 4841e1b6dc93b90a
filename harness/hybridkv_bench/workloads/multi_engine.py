"""`multi_engine`: `engines` engines at once, engine i TP rank i % tp (beyond tp: data-parallel replicas)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import Plan, Request, Shrink, WorkloadKind, cat, stream, tails


class MultiEngine(WorkloadKind, frozen=True, tag="multi_engine", kw_only=True):
    """`engines` engines at once; engine i is TP rank i % tp (beyond tp: data-parallel replicas).

    `gpus` places engine i on cuda:gpus[i]; empty: engine i on cuda:(i % visible GPUs), so on one GPU
    they all share cuda:0 and on eight GPUs each TP8 rank has its own (see `placement`)."""

    engines: int
    prompt_tokens: int
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive(self, "engines", "prompt_tokens")
        if self.gpus and len(self.gpus) != self.engines:
            raise ValueError(f"gpus names {len(self.gpus)} devices for {self.engines} engines: {list(self.gpus)}")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"gpus must be CUDA device indices >= 0, got {list(self.gpus)}")

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        # Engine i is rank i % tp of replica i // tp; the ranks of one replica see one prompt.
        ranks = tuple(i % tp for i in range(self.engines))
        prompts = [stream(rng, self.prompt_tokens) for _ in range(-(-self.engines // tp))]
        nxt = tails(rng, 1, 1)[0]
        # Aligned: every engine's store (load) starts together, so the aggregate is of concurrent copies.
        cold = tuple(Request(f"engine{i}-cold", prompts[i // tp], "cold", i, align="store")
                     for i in range(self.engines))
        warm = tuple(Request(f"engine{i}-warm", cat(prompts[i // tp], nxt), "warm", i, align="load")
                     for i in range(self.engines))
        return Plan(ranks, (cold, warm))

    def prefix_tokens(self) -> int:
        return self.prompt_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        return self.engines * one(self.prompt_tokens)

    def shrink(self, s: Shrink) -> MultiEngine:
        return msgspec.structs.replace(self, prompt_tokens=s.prefix(self.prompt_tokens))

    def placement(self, visible: int) -> list[int]:
        if self.gpus:
            bad = [g for g in self.gpus if g >= visible]
            if bad:
                raise ValueError(f"{self.label}: gpus {bad} do not exist; {visible} GPUs are visible")
            return list(self.gpus)
        return [i % visible for i in range(self.engines)]
