"""Replaying a `vllm-replay` scenario through real vLLM engines, one request at a time, each request three ways:

- `hybridkv`: an engine with the connector whose own prefix cache is dropped before every request (after its
  worker saw the previous request's stores committed), so its hit can only come from the cache server;
- `vllm`: an engine without the connector that has run the same requests in the same order and keeps its prefix
  cache: vLLM's own hit for this request, the ceiling the connector is measured against;
- `cold`: the same request again in that engine under a salt of its own (no cache entry matches it): the
  recompute whose greedy tokens both others must equal, and cold TTFT.

Per request: `shared_tokens`, the whole blocks it shares with what the `hybridkv` engine computed for the earlier
requests (their prompts and its answers: what the server can hold, what an attention-only model would resume from,
the most a hit can be; never the prompt's last token, which vLLM always computes); `hit_tokens`, what that engine
got from the server; `vllm_shared_tokens` and `vllm_hit_tokens`, the same for the `vllm` engine and its own cache
(the two differ where an earlier answer parted from the recompute's at a near-tie: the next chat turn, built from
the recompute's answer, shares that answer only up to there); the three TTFTs (vLLM's request metric, engines in
their own processes). A hit past `shared_tokens`, or `hybridkv` greedy tokens that are not the recompute's continuation
(`greedy.departure`: the same tokens and logprobs, up to where both part at a near-tie of two tokens), fails the
workload.
A chat turn is built from the recompute's answer, the same for all three engines.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path

import msgspec
import numpy as np

from hybridkv_bench.greedy import departure
from hybridkv_bench.replay.report import write_outputs
from hybridkv_bench.replay.rows import Replayed, failure, summary
from hybridkv_bench.replay.spec import ReplayScenario, ReplayWorkload
from hybridkv_bench.vllm_real import Engine, flush_connector, model_and_server, prompt
from hybridkv_bench.workloads.hits import ExpectedHits


class History:
    """The whole blocks the requests so far computed (prompt and all but the last generated token)."""

    def __init__(self, block: int):
        self.block = block
        self._stored = ExpectedHits(block, has_state=False, store_policy="all", retrieve_policy="boundary")

    def shared(self, tokens: list[int]) -> int:
        """Tokens of `tokens`' whole blocks that were computed before; never its last token's block."""
        return min(self._stored.shared(np.asarray(tokens)), (len(tokens) - 1) // self.block) * self.block

    def add(self, tokens: list[int]) -> None:
        self._stored.stored(np.asarray(tokens))


class Replay:
    """The two engines against one cache server, and what the requests so far computed."""

    def __init__(self, sc: ReplayScenario, model: Path, endpoint: str):
        self.sc = sc
        self.hybridkv = Engine(model, sc, endpoint)
        try:
            self.vllm = Engine(model, sc, None)
        except BaseException:
            self.hybridkv.close()
            raise
        block = self.hybridkv.llm.llm_engine.vllm_config.cache_config.block_size
        self.history = History(block)       # what the `hybridkv` engine computed: what the server can hold
        self.vllm_history = History(block)  # what the `vllm` engine computed unsalted: what its cache can hold
        # The first store, lookup, load and forward's one-time costs stay out of the figures: a prompt of two
        # blocks that no workload shares (its own token stream), run twice in each engine, the second from the
        # server or from vLLM's own cache.
        warmup = prompt(2 * block + 8, 77_777, sc.model.vocab)
        self.hybridkv.run(warmup, 2)
        self.drop_local_cache()
        self.hybridkv.run(warmup, 2)
        self.vllm.run(warmup, 2)
        self.vllm.run(warmup, 2)
        # Run right before each measured request in the same engine, so that no TTFT includes waking an engine
        # that sat idle while the other one ran: less than a block, so it neither stores nor caches anything.
        self.wake = prompt(block // 2, 88_888, sc.model.vocab)

    def drop_local_cache(self) -> None:
        """Wait until the server has committed every store the `hybridkv` engine made, then drop that engine's
        own prefix cache: its next request's hit can only come from the server."""
        self.hybridkv.llm.collective_rpc(flush_connector)
        if not self.hybridkv.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")

    def close(self) -> None:
        with contextlib.ExitStack() as stack:
            stack.callback(self.hybridkv.close)
            stack.callback(self.vllm.close)

    def request(self, w: ReplayWorkload, i: int, tokens: list[int]) -> tuple[Replayed, list[int]]:
        """Request i of `w` three ways; the recompute's greedy answer."""
        n = w.answer_tokens
        shared, vllm_shared = self.history.shared(tokens), self.vllm_history.shared(tokens)
        self.vllm.run(self.wake, 1)
        own = self.vllm.run(tokens, n, logprobs=2)
        cold = self.vllm.run(tokens, n, salt=f"recompute-{w.label}-{i}", logprobs=2)
        self.drop_local_cache()
        self.hybridkv.run(self.wake, 1)
        hkv = self.hybridkv.run(tokens, n, logprobs=2)
        self.history.add(tokens + hkv.tokens[:-1])
        self.vllm_history.add(tokens + own.tokens[:-1])
        return Replayed(workload=w.label, kind=w.kind, request=i, prompt_tokens=len(tokens),
                        shared_tokens=shared, hit_tokens=hkv.cached, vllm_shared_tokens=vllm_shared,
                        vllm_hit_tokens=own.cached,
                        ttft_cold_s=cold.ttft_s, ttft_hybridkv_s=hkv.ttft_s, ttft_vllm_s=own.ttft_s,
                        tokens_equal=hkv.tokens == cold.tokens, vllm_tokens_equal=own.tokens == cold.tokens,
                        departure=departure(hkv, cold) or "", vllm_departure=departure(own, cold) or ""), cold.tokens


def run_replay(sc: ReplayScenario, out: Path, scenario_text: str) -> tuple[Path, list[Replayed]]:
    """Replay every workload; write run.json (one case per workload), replay.csv, replay.png and report.md.
    vLLM must allow insecure serialization (VLLM_ALLOW_INSECURE_SERIALIZATION=1, set by the CLI): the engine's
    worker is asked to flush the connector's stores (`vllm_real.flush_connector`)."""
    from hybridkv_bench.results.folder import CaseResult, RunWriter
    from hybridkv_bench.results.host import collect_context

    rows: list[Replayed] = []
    with contextlib.ExitStack() as stack:
        model, server = model_and_server(stack, sc.model, sc.l1_gib)
        with RunWriter(out, {"text": scenario_text, **msgspec.to_builtins(sc)}, collect_context()) as writer:
            replay = Replay(sc, model, server.endpoint)
            stack.callback(replay.close)
            for wi, w in enumerate(sc.workloads):
                seed = sc.seed_of(wi)
                tokens: list[int] = []
                answer: list[int] = []
                done: list[Replayed] = []
                for i in range(w.count()):
                    tokens = w.next_prompt(i, seed, sc.model.vocab, tokens, answer)
                    row, answer = replay.request(w, i, tokens)
                    done.append(row)
                why = failure(done)
                writer.add_case(CaseResult(
                    name=f"vllm-replay-{w.label}", workload=w.kind,
                    axes={"engine": "vllm-real"}, status="failed" if why else "ok", error=why,
                    metrics=summary(done), details={"requests": [asdict(r) for r in done]}))
                rows += done
            writer.record.context["block_tokens"] = replay.history.block
            writer.record.context["engine_start_s"] = replay.hybridkv.start_s
        write_outputs(out, sc, rows)
    return out, rows
