"""`multi_turn`: chats whose prefix grows by `turn_tokens` a turn; every turn after the first resumes the last."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import msgspec
import numpy as np

from hybridkv_bench.strict import positive
from hybridkv_bench.workloads.base import GIB, Plan, Request, Shrink, Sizing, WorkloadKind, cat, stream

PrefetchMode = Literal["off", "on", "compare"]
MAX_THINK_S = 60.0


class MultiTurn(WorkloadKind, frozen=True, tag="multi_turn", kw_only=True):
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
        positive(self, "system_tokens", "turn_tokens", "turns", "conversations")
        if not 0 <= self.think_s <= MAX_THINK_S:
            raise ValueError(f"think_s must lie in [0, {MAX_THINK_S:g}] seconds, got {self.think_s}")
        if self.prefetch != "off" and self.turns < 2:
            raise ValueError(f"prefetch = {self.prefetch!r} needs turns >= 2 (a warm turn to prefetch for)")
        if self.prefetch == "compare" and self.conversations < 2:
            raise ValueError("prefetch = 'compare' needs conversations >= 2 (interleaved, to push each other to L2)")

    @property
    def conversation_tokens(self) -> int:
        """Tokens of a whole conversation: its system prompt and every turn."""
        return self.system_tokens + self.turns * self.turn_tokens

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        """Independent conversations (own system prompt); turn t's prompt is turn t-1's plus turn_tokens new
        tokens. Interleaved round-robin as a server sees them, or (the `l1` pass of `compare`) one
        conversation after another. Each pass of `compare` draws fresh conversations."""
        passes = ((("l1", False, False), ("l2", True, False), ("l2_prefetch", True, True))
                  if self.prefetch == "compare" else (("", True, self.prefetch == "on"),))
        reqs: list[Request] = []
        for tier, interleaved, hint in passes:
            convs = [(stream(rng, self.system_tokens), [stream(rng, self.turn_tokens) for _ in range(self.turns)])
                     for _ in range(self.conversations)]
            order = ([(t, c) for t in range(self.turns) for c in range(self.conversations)] if interleaved
                     else [(t, c) for c in range(self.conversations) for t in range(self.turns)])
            prefix = f"{tier}-" if tier else ""
            for t, c in order:
                system, turns = convs[c]
                history = self.system_tokens + t * self.turn_tokens  # what the previous turn's prompt held
                reqs.append(Request(f"{prefix}conv{c}-turn{t}", cat(system, *turns[:t + 1]),
                                    "cold" if t == 0 else "warm", tier=tier if t else "",
                                    think_s=self.think_s if t else 0.0, hint_tokens=history if hint and t else 0))
        return Plan((0,), (tuple(reqs),))

    def prefix_tokens(self) -> int:
        return self.system_tokens + (self.turns - 1) * self.turn_tokens

    def working_set(self, one: Callable[[int], int]) -> int:
        passes = 3 if self.prefetch == "compare" else 1  # l1, l2, l2_prefetch: fresh conversations each
        return passes * self.conversations * one(self.conversation_tokens)

    def shrink(self, s: Shrink) -> MultiTurn:
        return msgspec.structs.replace(
            self, system_tokens=s.prefix(self.system_tokens), turn_tokens=s.step(self.turn_tokens),
            turns=s.count(self.turns, 3),
            conversations=s.count(self.conversations, 2 if self.prefetch == "compare" else 1))

    def least_l1_gib(self, one: Callable[[int], int]) -> float:
        least = one(self.prefix_tokens()) / GIB
        if self.prefetch == "compare":  # the l1 tier: one conversation fits
            least = max(least, one(self.conversation_tokens) / GIB)
        return least

    def refit(self, l1_gib: float, one: Callable[[int], int]) -> MultiTurn:
        if self.prefetch != "compare":
            return self
        # enough interleaved conversations to push each other out of the new L1, as before scaling
        first = one(self.system_tokens + self.turn_tokens) / GIB
        return msgspec.structs.replace(self, conversations=max(self.conversations, math.floor(l1_gib / first) + 2))

    def l2_holds(self, fitted_before: bool) -> bool:
        return self.prefetch == "compare"

    def problem(self, sizing: Sizing) -> str:
        """Why the prefetch setting cannot measure what it is for ("" when it can)."""
        server = sizing.server
        if self.prefetch == "off":
            return ""
        if server.l2_gib <= 0:
            return f"prefetch = {self.prefetch!r} brings prefixes back from L2, and server.l2_gib is 0"
        if not sizing.sends_prefetch:
            return "prefetch hints are sent by the sim and transformers engines; the vllm engine sends none"
        if self.prefetch != "compare":
            return ""
        l1 = server.l1_bytes
        conv = sizing.prefix_bytes(self.conversation_tokens)
        if conv > l1:
            return (f"one conversation stores {conv / GIB:.3f} GiB, more than server.l1_gib "
                    f"{server.l1_gib:g}: the l1 tier would not come from L1")
        # Between two turns of one conversation the others each look up and store at least their first
        # turn's prefix: that must exceed L1 for this conversation's prefix to have left it.
        others = (self.conversations - 1) * sizing.prefix_bytes(self.system_tokens + self.turn_tokens)
        if others <= l1:
            return (f"the other {self.conversations - 1} conversations' first turns store {others / GIB:.3f} GiB, "
                    f"which fits in server.l1_gib {server.l1_gib:g}: the l2 tiers would still come from L1 "
                    "(add conversations or shrink L1)")
        return ""
