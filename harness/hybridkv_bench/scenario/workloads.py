"""The `[[workloads]]` tables of a scenario file: one strict struct per kind (what each measures is in
harness/README.md; `workloads.build_plan` turns them into requests), and `engine_gpus`, where the engines
of a workload run on CUDA. Re-exported by `scenario`, which holds the rest of the file's structs."""

from __future__ import annotations

from typing import Literal

import msgspec


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The base of every scenario struct: keyword-only, frozen, and an unknown key is an error."""


def _positive(struct: msgspec.Struct, *fields: str) -> None:
    for f in fields:
        v = getattr(struct, f)
        if v < 1:
            raise ValueError(f"{f} must be >= 1, got {v}")


class _Workload(_Strict, frozen=True, tag_field="kind"):
    name: str = ""  # "" : the kind; names must be unique within a scenario

    @property
    def label(self) -> str:
        return self.name or self.kind

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


class LongDocQA(_Workload, frozen=True, tag="long_doc_qa", kw_only=True):
    """Each document is asked cold (full prefill, store), then warm (lookup, load, prefill the question)."""

    prompt_tokens: int
    question_tokens: int
    documents: int = 1

    def __post_init__(self) -> None:
        _positive(self, "prompt_tokens", "question_tokens", "documents")


PrefetchMode = Literal["off", "on", "compare"]
MAX_THINK_S = 60.0


class MultiTurn(_Workload, frozen=True, tag="multi_turn", kw_only=True):
    """Chats whose prefix grows by `turn_tokens` a turn; every turn after the first resumes the last.

    `think_s`: before each warm turn the engine waits this long, from the moment a frontend knows the
    user is back (the next message arrives, or the user starts typing) to the request's arrival; TTFT
    starts at the arrival. `prefetch = "on"` sends `KVTransfer.prefetch(history)` as that time starts.
    `prefetch = "compare"` runs three passes of fresh conversations in one case and labels their warm
    turns by tier: `l1` (one conversation after another: the prefix is still in L1), `l2` (conversations
    interleaved, their working set larger than L1: the prefix comes back from L2 at the lookup) and
    `l2_prefetch` (the same, with the hint)."""

    system_tokens: int
    turn_tokens: int
    turns: int
    conversations: int = 1
    think_s: float = 0.0
    prefetch: PrefetchMode = "off"

    def __post_init__(self) -> None:
        _positive(self, "system_tokens", "turn_tokens", "turns", "conversations")
        if not 0 <= self.think_s <= MAX_THINK_S:
            raise ValueError(f"think_s must lie in [0, {MAX_THINK_S:g}] seconds, got {self.think_s}")
        if self.prefetch != "off" and self.turns < 2:
            raise ValueError(f"prefetch = {self.prefetch!r} needs turns >= 2 (a warm turn to prefetch for)")
        if self.prefetch == "compare" and self.conversations < 2:
            raise ValueError("prefetch = 'compare' needs conversations >= 2 (interleaved, to push each other to L2)")


class FanOut(_Workload, frozen=True, tag="fan_out", kw_only=True):
    """`requests` requests share one system prompt and differ in a `user_tokens` tail."""

    system_tokens: int
    user_tokens: int
    requests: int

    def __post_init__(self) -> None:
        _positive(self, "system_tokens", "user_tokens", "requests")


class Divergence(_Workload, frozen=True, tag="divergence", kw_only=True):
    """Two prompts share a prefix and differ from a point inside a chunk or exactly at a chunk edge."""

    prompt_tokens: int
    at: Literal["inside_chunk", "chunk_edge"]

    def __post_init__(self) -> None:
        _positive(self, "prompt_tokens")


class L1Pressure(_Workload, frozen=True, tag="l1_pressure", kw_only=True):
    """More documents than L1 holds: the early ones must spill to L2 and come back from it."""

    documents: int
    prompt_tokens: int

    def __post_init__(self) -> None:
        _positive(self, "documents", "prompt_tokens")


class MultiEngine(_Workload, frozen=True, tag="multi_engine", kw_only=True):
    """`engines` engines at once; engine i is TP rank i % tp (beyond tp: data-parallel replicas).

    `gpus` places engine i on cuda:gpus[i]; empty: engine i on cuda:(i % visible GPUs), so on one GPU
    they all share cuda:0 and on eight GPUs each TP8 rank has its own (see `engine_gpus`)."""

    engines: int
    prompt_tokens: int
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _positive(self, "engines", "prompt_tokens")
        if self.gpus and len(self.gpus) != self.engines:
            raise ValueError(f"gpus names {len(self.gpus)} devices for {self.engines} engines: {list(self.gpus)}")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"gpus must be CUDA device indices >= 0, got {list(self.gpus)}")


class StoreWhileLoad(_Workload, frozen=True, tag="store_while_load", kw_only=True):
    """Two engines on one device: one loads document d while the other stores document d+1, as a
    serving engine stores one request while it resumes another; `rounds` such overlaps."""

    prompt_tokens: int
    rounds: int = 3

    def __post_init__(self) -> None:
        _positive(self, "prompt_tokens", "rounds")


Workload = LongDocQA | MultiTurn | FanOut | Divergence | L1Pressure | MultiEngine | StoreWhileLoad


def engine_gpus(w: Workload, visible: int) -> list[int]:
    """The CUDA device index of each engine of `w` when `visible` GPUs are visible (see MultiEngine)."""
    if visible < 1:
        raise ValueError(f"no CUDA device is visible to place the engines of {w.label} on")
    if isinstance(w, MultiEngine):
        if w.gpus:
            bad = [g for g in w.gpus if g >= visible]
            if bad:
                raise ValueError(f"{w.label}: gpus {bad} do not exist; {visible} GPUs are visible")
            return list(w.gpus)
        return [i % visible for i in range(w.engines)]
    engines = 2 if isinstance(w, StoreWhileLoad) else 1
    return [0] * engines
