"""`fan_out`: `requests` requests share one system prompt and differ in a `user_tokens` tail."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import Plan, Request, Shrink, WorkloadKind, cat, stream, tails


class FanOut(WorkloadKind, frozen=True, tag="fan_out", kw_only=True):
    """`requests` requests share one system prompt and differ in a `user_tokens` tail."""

    system_tokens: int
    user_tokens: int
    requests: int

    def __post_init__(self) -> None:
        positive(self, "system_tokens", "user_tokens", "requests")

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        system = stream(rng, self.system_tokens)
        reqs = [Request(f"user{i}", cat(system, tail), "cold" if i == 0 else "warm")
                for i, tail in enumerate(tails(rng, self.user_tokens, self.requests))]
        return Plan((0,), (tuple(reqs),))

    def prefix_tokens(self) -> int:
        return self.system_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        shared = one(self.system_tokens)
        return shared + self.requests * (one(self.system_tokens + self.user_tokens) - shared)

    def shrink(self, s: Shrink) -> FanOut:
        return msgspec.structs.replace(
            self, system_tokens=s.prefix(self.system_tokens), user_tokens=s.tail(self.user_tokens),
                            requests=s.count(self.requests, 2))
