"""A `vllm-replay` scenario file: the engines' settings and the workloads replayed through them.

Three workload kinds, the traffic whose hits a hybrid model loses when states are kept only where a prefill step
ends: `rag` (one document, many questions), `chat` (turn N+1 is turn N's prompt, its generated answer and new
text) and `fan_out` (one system prompt, many different user suffixes). A workload's requests are generated from
its seed; a chat turn also from the previous turn's greedy answer, so `Workload.next_prompt` is given it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from hybridkv_bench.strict import Strict, positive
from hybridkv_bench.vllm_real import ModelShape, load_toml, prompt


class ReplayWorkload(Strict, frozen=True, kw_only=True, tag_field="kind"):
    """The base of the three kinds: `count` requests; request i's prompt from the previous one and its answer."""

    name: str = ""  # "": the kind; names must be unique within a scenario
    answer_tokens: int = 16  # greedy tokens generated per request
    seed: int = 0  # the workload's token streams; 0: its position in the file plus one

    @property
    def label(self) -> str:
        return self.name or self.kind

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)

    def count(self) -> int:
        raise NotImplementedError

    def longest(self) -> int:
        """The tokens of its longest request plus its answer."""
        raise NotImplementedError

    def next_prompt(self, i: int, seed: int, vocab: int, previous: list[int], answer: list[int]) -> list[int]:
        """Request i's prompt, given request i-1's prompt and greedy answer (empty for i = 0)."""
        raise NotImplementedError


class Rag(ReplayWorkload, frozen=True, kw_only=True, tag="rag"):
    """One document of `document_tokens`, then `questions` requests each the document and a question of
    `question_tokens` of its own."""

    document_tokens: int = 2500
    question_tokens: int = 64
    questions: int = 6

    def __post_init__(self) -> None:
        positive(self, "document_tokens", "question_tokens", "questions", "answer_tokens")

    def count(self) -> int:
        return self.questions

    def longest(self) -> int:
        return self.document_tokens + self.question_tokens + self.answer_tokens

    def next_prompt(self, i: int, seed: int, vocab: int, previous: list[int], answer: list[int]) -> list[int]:
        return prompt(self.document_tokens, seed, vocab) + prompt(self.question_tokens, seed * 1000 + i, vocab)


class FanOut(ReplayWorkload, frozen=True, kw_only=True, tag="fan_out"):
    """One system prompt of `system_tokens` shared by `requests` requests, each with a user suffix of
    `suffix_tokens` of its own."""

    system_tokens: int = 1500
    suffix_tokens: int = 300
    requests: int = 6

    def __post_init__(self) -> None:
        positive(self, "system_tokens", "suffix_tokens", "requests", "answer_tokens")

    def count(self) -> int:
        return self.requests

    def longest(self) -> int:
        return self.system_tokens + self.suffix_tokens + self.answer_tokens

    def next_prompt(self, i: int, seed: int, vocab: int, previous: list[int], answer: list[int]) -> list[int]:
        return prompt(self.system_tokens, seed, vocab) + prompt(self.suffix_tokens, seed * 1000 + i, vocab)


class Chat(ReplayWorkload, frozen=True, kw_only=True, tag="chat"):
    """A conversation of `turns` turns: the first prompt has `first_tokens`; turn N+1 is turn N's prompt, its
    greedy answer of `answer_tokens` and `user_tokens` new tokens."""

    first_tokens: int = 600
    answer_tokens: int = 120
    user_tokens: int = 60
    turns: int = 5

    def __post_init__(self) -> None:
        positive(self, "first_tokens", "answer_tokens", "user_tokens", "turns")

    def count(self) -> int:
        return self.turns

    def longest(self) -> int:
        return self.first_tokens + self.turns * self.answer_tokens + (self.turns - 1) * self.user_tokens

    def next_prompt(self, i: int, seed: int, vocab: int, previous: list[int], answer: list[int]) -> list[int]:
        if i == 0:
            return prompt(self.first_tokens, seed, vocab)
        return previous + answer + prompt(self.user_tokens, seed * 1000 + i, vocab)


Workload = Rag | Chat | FanOut


class ReplayScenario(Strict, frozen=True, kw_only=True):
    """A `vllm-replay` scenario file."""

    name: str
    model: ModelShape = msgspec.field(default_factory=ModelShape)
    workloads: list[Workload]
    max_model_len: int = 8192
    step_tokens: int = 0            # vLLM's --max-num-batched-tokens; 0: vLLM's own default
    kv_cache_gib: float = 1.0       # each engine's
    l1_gib: float = 1.0             # the cache server's
    # the connector's kv_connector_extra_config keys beyond the endpoint (e.g. state_every_chunks = 4)
    connector: dict[str, str | int | float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("workloads must name at least one workload (kind = rag, chat or fan_out)")
        names = [w.label for w in self.workloads]
        if len(set(names)) != len(names):
            raise ValueError(f"workload names must be unique, got {names} (give each a name)")
        for w in self.workloads:
            if w.longest() > self.max_model_len:
                raise ValueError(f"workload {w.label!r}: its longest request and answer ({w.longest()} tokens) "
                                 f"exceed max_model_len {self.max_model_len}")
        if self.step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0 (0: vLLM's default), got {self.step_tokens}")
        if not (0 < self.kv_cache_gib < 1024 and 0 < self.l1_gib < 1024):
            raise ValueError(f"kv_cache_gib and l1_gib must lie in (0, 1024), got {self.kv_cache_gib}, "
                             f"{self.l1_gib}")

    def seed_of(self, i: int) -> int:
        """Workload i's seed: its own, or i + 1 (each workload's tokens its own, none shared across them)."""
        return self.workloads[i].seed or i + 1


def load_replay_scenario(path: str | Path) -> ReplayScenario:
    """The scenario, or ValueError naming the file and what is wrong with it."""
    return load_toml(path, ReplayScenario)
