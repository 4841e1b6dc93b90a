"""`long_doc_qa`: each document is asked cold (full prefill, store), then warm (lookup, load, prefill the
question)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import Plan, Request, Shrink, WorkloadKind, cat, stream, tails


class LongDocQA(WorkloadKind, frozen=True, tag="long_doc_qa", kw_only=True):
    """Each document is asked cold (full prefill, store), then warm (lookup, load, prefill the question)."""

    prompt_tokens: int
    question_tokens: int
    documents: int = 1

    def __post_init__(self) -> None:
        positive(self, "prompt_tokens", "question_tokens", "documents")

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        reqs: list[Request] = []
        for d in range(self.documents):
            doc = stream(rng, self.prompt_tokens)
            q_cold, q_warm = tails(rng, self.question_tokens, 2)
            reqs += [Request(f"doc{d}-cold", cat(doc, q_cold), "cold"),
                     Request(f"doc{d}-warm", cat(doc, q_warm), "warm")]
        return Plan((0,), (tuple(reqs),))

    def prefix_tokens(self) -> int:
        return self.prompt_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        return self.documents * one(self.prompt_tokens + self.question_tokens)

    def shrink(self, s: Shrink) -> LongDocQA:
        return msgspec.structs.replace(
            self, prompt_tokens=s.prefix(self.prompt_tokens), question_tokens=s.tail(self.question_tokens),
                            documents=s.count(self.documents, 1))
