"""`store_while_load`: two engines on one device, one loading a document while the other stores the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import Plan, Request, Shrink, WorkloadKind, cat, stream, tails


class StoreWhileLoad(WorkloadKind, frozen=True, tag="store_while_load", kw_only=True):
    """Two engines on one device: one loads document d while the other stores document d+1, as a
    serving engine stores one request while it resumes another; `rounds` such overlaps."""

    prompt_tokens: int
    rounds: int = 3

    engine_count: ClassVar[int] = 2

    def __post_init__(self) -> None:
        positive(self, "prompt_tokens", "rounds")

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        # Two engines of one namespace: in round r engine 0 resumes document r-1 (a load) while
        # engine 1 stores document r (a cold prefill's store); round 0 only stores document 0.
        docs = [stream(rng, self.prompt_tokens) for _ in range(self.rounds + 1)]
        nxt = tails(rng, 1, 1)[0]
        phases: list[tuple[Request, ...]] = [(Request("doc0-store", docs[0], "cold", 1),)]
        phases += [(Request(f"doc{r - 1}-load", cat(docs[r - 1], nxt), "warm", 0, align="load"),
                    Request(f"doc{r}-store", docs[r], "cold", 1, align="store"))
                   for r in range(1, self.rounds + 1)]
        return Plan((0, 0), tuple(phases))

    def prefix_tokens(self) -> int:
        return self.prompt_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        return (self.rounds + 1) * one(self.prompt_tokens)

    def shrink(self, s: Shrink) -> StoreWhileLoad:
        return msgspec.structs.replace(
            self, prompt_tokens=s.prefix(self.prompt_tokens), rounds=s.count(self.rounds, 1))
