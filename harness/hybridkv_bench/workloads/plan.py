"""Token streams of each workload kind, and the hit each request must get.

`build_plan` turns a scenario workload into a `Plan`: which engines run (TP rank of each) and the
requests each runs, in phases separated by a barrier (engines run one phase at once). Token ids are
drawn from a generator seeded by the scenario seed and the workload's name, so every repeat and every
case of a run replays the same prompts. Prompts that must part ways differ at their first own token.

`ExpectedHits` is the test oracle: from the prompts an engine namespace stored, it applies DESIGN.md's
hit rule (attention for every chunk of the prefix, recurrent state at its last chunk; every group of
every chunk when the retrieve policy is `all`) under the case's store policy. The runner fails a
case whose server answers anything else.
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hybridkv_bench.scenario.workloads import (
    Divergence,
    FanOut,
    L1Pressure,
    LongDocQA,
    MultiEngine,
    MultiTurn,
    StoreWhileLoad,
    Workload,
)

VOCAB = 151_936  # Qwen3.5/3.6's vocabulary; token ids only feed chunk keys


@dataclass(frozen=True, slots=True)
class Request:
    name: str
    tokens: np.ndarray
    phase: Literal["cold", "warm"]  # cold: the first time its prefix is asked for in a repeat
    engine: int = 0
    # "load" / "store": this request's lookup+load (its store) starts together with the other aligned
    # requests of its phase, so their transfers overlap; "": no alignment
    align: Literal["", "load", "store"] = ""
    # multi_turn: where the warm prefix is meant to come from (`l1`, `l2`, `l2_prefetch`; "": not compared),
    # the user's think time before the request arrives, and the tokens known when it starts (the
    # conversation so far) that a prefetch hint names (0: no hint)
    tier: str = ""
    think_s: float = 0.0
    hint_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """Engines (their TP ranks) and their requests. Within a phase each engine runs its requests in
    order, all engines at once; a barrier separates phases."""

    ranks: tuple[int, ...]
    phases: tuple[tuple[Request, ...], ...]

    @property
    def requests(self) -> list[Request]:
        return [r for phase in self.phases for r in phase]

    def max_tokens(self, engine: int) -> int:
        return max((len(r.tokens) for r in self.requests if r.engine == engine), default=0)


def _rng(seed: int, label: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(label.encode())])


def _stream(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n, dtype=np.int64)


def _tails(rng: np.random.Generator, n: int, count: int) -> list[np.ndarray]:
    """`count` token tails of length n whose first tokens all differ."""
    out = rng.integers(0, VOCAB, (count, n), dtype=np.int64)
    out[:, 0] = rng.choice(VOCAB, count, replace=False)
    return list(out)


def _cat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts)


def build_plan(w: Workload, chunk_tokens: int, seed: int, tp: int = 1) -> Plan:
    """The requests of workload `w` (see harness/README.md for what each kind measures)."""
    rng = _rng(seed, w.label)
    match w:
        case LongDocQA():
            reqs: list[Request] = []
            for d in range(w.documents):
                doc = _stream(rng, w.prompt_tokens)
                q_cold, q_warm = _tails(rng, w.question_tokens, 2)
                reqs += [Request(f"doc{d}-cold", _cat(doc, q_cold), "cold"),
                         Request(f"doc{d}-warm", _cat(doc, q_warm), "warm")]
            return Plan((0,), (tuple(reqs),))
        case MultiTurn():
            return Plan((0,), (tuple(_multi_turn(w, rng)),))
        case FanOut():
            system = _stream(rng, w.system_tokens)
            reqs = [Request(f"user{i}", _cat(system, tail), "cold" if i == 0 else "warm")
                    for i, tail in enumerate(_tails(rng, w.user_tokens, w.requests))]
            return Plan((0,), (tuple(reqs),))
        case Divergence():
            n = w.prompt_tokens // chunk_tokens
            shared = (n // 2) * chunk_tokens + (chunk_tokens // 2 if w.at == "inside_chunk" else 0)
            a = _stream(rng, w.prompt_tokens)
            b = _cat(a[:shared], _stream(rng, w.prompt_tokens - shared))
            b[shared] = (a[shared] + 1) % VOCAB
            return Plan((0,), ((Request("first", a, "cold"), Request("diverged", b, "warm")),))
        case L1Pressure():
            # Store every document, then re-read each one in order (+ one new token, as a next turn would):
            # the early ones were pushed out of L1 and must come back from L2.
            docs = [_stream(rng, w.prompt_tokens) for _ in range(w.documents)]
            nxt = _tails(rng, 1, 1)[0]
            stores = [Request(f"doc{d}-store", doc, "cold") for d, doc in enumerate(docs)]
            rereads = [Request(f"doc{d}-reread", _cat(doc, nxt), "warm") for d, doc in enumerate(docs)]
            return Plan((0,), (tuple(stores + rereads),))
        case MultiEngine():
            # Engine i is rank i % tp of replica i // tp; the ranks of one replica see one prompt.
            ranks = tuple(i % tp for i in range(w.engines))
            prompts = [_stream(rng, w.prompt_tokens) for _ in range(-(-w.engines // tp))]
            nxt = _tails(rng, 1, 1)[0]
            # Aligned: every engine's store (load) starts together, so the aggregate is of concurrent copies.
            cold = tuple(Request(f"engine{i}-cold", prompts[i // tp], "cold", i, align="store")
                         for i in range(w.engines))
            warm = tuple(Request(f"engine{i}-warm", _cat(prompts[i // tp], nxt), "warm", i, align="load")
                         for i in range(w.engines))
            return Plan(ranks, (cold, warm))
        case StoreWhileLoad():
            # Two engines of one namespace: in round r engine 0 resumes document r-1 (a load) while
            # engine 1 stores document r (a cold prefill's store); round 0 only stores document 0.
            docs = [_stream(rng, w.prompt_tokens) for _ in range(w.rounds + 1)]
            nxt = _tails(rng, 1, 1)[0]
            phases: list[tuple[Request, ...]] = [(Request("doc0-store", docs[0], "cold", 1),)]
            phases += [(Request(f"doc{r - 1}-load", _cat(docs[r - 1], nxt), "warm", 0, align="load"),
                        Request(f"doc{r}-store", docs[r], "cold", 1, align="store"))
                       for r in range(1, w.rounds + 1)]
            return Plan((0, 0), tuple(phases))
    raise AssertionError(w)


def _multi_turn(w: MultiTurn, rng: np.random.Generator) -> list[Request]:
    """Independent conversations (own system prompt); turn t's prompt is turn t-1's plus turn_tokens new
    tokens. Interleaved round-robin as a server sees them, or (the `l1` pass of `compare`) one
    conversation after another. Each pass of `compare` draws fresh conversations."""
    passes = ((("l1", False, False), ("l2", True, False), ("l2_prefetch", True, True)) if w.prefetch == "compare"
              else (("", True, w.prefetch == "on"),))
    reqs: list[Request] = []
    for tier, interleaved, hint in passes:
        convs = [(_stream(rng, w.system_tokens), [_stream(rng, w.turn_tokens) for _ in range(w.turns)])
                 for _ in range(w.conversations)]
        order = ([(t, c) for t in range(w.turns) for c in range(w.conversations)] if interleaved
                 else [(t, c) for c in range(w.conversations) for t in range(w.turns)])
        prefix = f"{tier}-" if tier else ""
        for t, c in order:
            system, turns = convs[c]
            history = w.system_tokens + t * w.turn_tokens  # what the previous turn's prompt held
            reqs.append(Request(f"{prefix}conv{c}-turn{t}", _cat(system, *turns[:t + 1]), "cold" if t == 0 else "warm",
                                tier=tier if t else "", think_s=w.think_s if t else 0.0,
                                hint_tokens=history if hint and t else 0))
    return reqs


class ExpectedHits:
    """The hit, in chunks, that one engine namespace must get, given the prompts it stored."""

    def __init__(self, chunk_tokens: int, has_state: bool, store_policy: str, retrieve_policy: str):
        self.chunk_tokens = chunk_tokens
        self.has_state = has_state
        self.store_policy = store_policy
        self.retrieve_policy = retrieve_policy
        self._attention: set[bytes] = set()
        self._state: set[bytes] = set()
        self._lock = threading.Lock()

    def prefixes(self, tokens: np.ndarray) -> list[bytes]:
        """One id per full chunk of `tokens`, naming the whole prefix up to that chunk's end."""
        data = np.asarray(tokens, "<u4").tobytes()
        step, out, prev = 4 * self.chunk_tokens, [], b""
        for off in range(0, len(data) - step + 1, step):
            prev = hashlib.blake2b(prev + data[off:off + step], digest_size=16).digest()
            out.append(prev)
        return out

    def lookup(self, tokens: np.ndarray) -> int:
        ids = self.prefixes(tokens)
        with self._lock:
            full = 0
            for p in ids:
                if p not in self._attention or (self.retrieve_policy == "all" and self.has_state
                                                 and p not in self._state):
                    break
                full += 1
            for n in range(full, 0, -1):
                if not self.has_state or ids[n - 1] in self._state:
                    return n
        return 0

    def stored(self, tokens: np.ndarray) -> None:
        ids = self.prefixes(tokens)
        if not ids:
            return
        with self._lock:
            self._attention.update(ids)
            self._state.update(ids if self.store_policy == "all" else ids[-1:])

    def clear(self) -> None:
        with self._lock:
            self._attention.clear()
            self._state.clear()
