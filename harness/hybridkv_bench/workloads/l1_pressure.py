"""`l1_pressure`: more documents than L1 holds; the early ones must spill to L2 and come back from it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import GIB, Plan, Request, Shrink, Sizing, WorkloadKind, cat, stream, tails


class L1Pressure(WorkloadKind, frozen=True, tag="l1_pressure", kw_only=True):
    """More documents than L1 holds: the early ones must spill to L2 and come back from it."""

    documents: int
    prompt_tokens: int

    spills: ClassVar[bool] = True

    def __post_init__(self) -> None:
        positive(self, "documents", "prompt_tokens")

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        # Store every document, then re-read each one in order (+ one new token, as a next turn would):
        # the early ones were pushed out of L1 and must come back from L2.
        docs = [stream(rng, self.prompt_tokens) for _ in range(self.documents)]
        nxt = tails(rng, 1, 1)[0]
        stores = [Request(f"doc{d}-store", doc, "cold") for d, doc in enumerate(docs)]
        rereads = [Request(f"doc{d}-reread", cat(doc, nxt), "warm") for d, doc in enumerate(docs)]
        return Plan((0,), (tuple(stores + rereads),))

    def prefix_tokens(self) -> int:
        return self.prompt_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        return self.documents * one(self.prompt_tokens)

    def shrink(self, s: Shrink) -> L1Pressure:
        return msgspec.structs.replace(self, prompt_tokens=s.prefix(self.prompt_tokens),
                                       documents=s.count(self.documents, 1))

    def refit(self, l1_gib: float, one: Callable[[int], int]) -> L1Pressure:
        # as many documents as it takes to exceed the scaled L1 by half again
        if self.working_set(one) / GIB <= l1_gib:
            return msgspec.structs.replace(self, documents=math.ceil(1.5 * l1_gib / (one(self.prompt_tokens) / GIB)))
        return self

    def l2_holds(self, fitted_before: bool) -> bool:
        return fitted_before

    def problem(self, sizing: Sizing) -> str:
        server = sizing.server
        total = self.working_set(sizing.prefix_bytes)
        if total <= server.l1_bytes:
            return (f"{self.documents} x {self.prompt_tokens} tokens store {total / GIB:.3f} GiB, "
                    f"which fits in server.l1_gib {server.l1_gib}: nothing would spill")
        if server.l2_gib <= 0:
            return "needs an L2 to spill to (server.l2_gib is 0)"
        return ""
