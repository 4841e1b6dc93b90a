"""`divergence`: two prompts share a prefix and differ from a point inside a chunk or exactly at a chunk edge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import VOCAB, Plan, Request, Shrink, Sizing, WorkloadKind, cat, stream


class Divergence(WorkloadKind, frozen=True, tag="divergence", kw_only=True):
    """Two prompts share a prefix and differ from a point inside a chunk or exactly at a chunk edge."""

    prompt_tokens: int
    at: Literal["inside_chunk", "chunk_edge"]

    def __post_init__(self) -> None:
        positive(self, "prompt_tokens")

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        n = self.prompt_tokens // chunk_tokens
        shared = (n // 2) * chunk_tokens + (chunk_tokens // 2 if self.at == "inside_chunk" else 0)
        a = stream(rng, self.prompt_tokens)
        b = cat(a[:shared], stream(rng, self.prompt_tokens - shared))
        b[shared] = (a[shared] + 1) % VOCAB
        return Plan((0,), ((Request("first", a, "cold"), Request("diverged", b, "warm")),))

    def prefix_tokens(self) -> int:
        return self.prompt_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        return 2 * one(self.prompt_tokens)

    def shrink(self, s: Shrink) -> Divergence:
        return msgspec.structs.replace(
            self, prompt_tokens=s.prefix(self.prompt_tokens))

    def problem(self, sizing: Sizing) -> str:
        if self.prompt_tokens < 2 * sizing.chunk:
            return f"prompt_tokens {self.prompt_tokens} must span at least 2 chunks ({2 * sizing.chunk})"
        return ""
