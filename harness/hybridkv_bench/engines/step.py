"""The one request step that engines in threads (the runner's) and in processes (`engines.procs`) share:
run a request, check its hit against the stored prefixes, record its row; and the barriers that align a
phase's transfers."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hybridkv_bench.engines.base import CLIENT_TIMEOUT_S, Engine, HitMismatch
from hybridkv_bench.metrics import RequestRow
from hybridkv_bench.workloads.base import Plan, Request
from hybridkv_bench.workloads.hits import ExpectedHits


def since(t: float, origin: float) -> float:
    """A perf_counter stamp as seconds from the repeat's start (0.0: not recorded)."""
    return t - origin if t else 0.0


@dataclass(frozen=True, slots=True)
class RepeatInfo:
    """What every request row of one repeat records beside its own figures."""

    case: str
    workload: str
    repeat: int
    chunk: int
    origin: float  # perf_counter at the repeat's start: load_start_s / store_start_s count from it


def request_index(plan: Plan) -> dict[int, int]:
    """Each request's index in the plan (its `request` column), by identity."""
    return {id(r): i for i, r in enumerate(plan.requests)}


def run_request(eng: Engine, oracle: ExpectedHits, req: Request, step: int, index: int, info: RepeatInfo,
                align) -> RequestRow:
    """Run one request on `eng`, check its hit against `oracle`, record what it stored; its row. `align`:
    the barrier of this phase's aligned requests (threading's or multiprocessing's), or None."""
    expect, shared = oracle.lookup(req.tokens), oracle.shared(req.tokens)
    name = f"r{info.repeat}-{req.name}"
    if req.think_s or req.hint_tokens:  # multi_turn: the user's think time, the hint sent as it starts
        hint = eng.kv.prefetch(req.tokens[:req.hint_tokens]) if req.hint_tokens else None
        time.sleep(req.think_s)  # nothing else runs on this engine meanwhile; the server reads L2
        if hint is not None:
            hint.result(timeout=CLIENT_TIMEOUT_S)  # answered before any read ends; an error fails the case
    if align is not None and req.align:
        def gate(point: str) -> None:
            if point == req.align:
                align.wait()

        res = eng.run(name, req.tokens, gate)
    else:  # other engine kinds' run(request_id, tokens) need not take a gate
        res = eng.run(name, req.tokens)
    if res.hit_tokens != expect * info.chunk:
        raise HitMismatch(f"{req.name}: the server's hit is {res.hit_tokens} tokens, the stored prefixes "
                          f"allow exactly {expect * info.chunk} ({expect} chunks of {info.chunk})")
    oracle.stored(req.tokens)
    return RequestRow(case=info.case, workload=info.workload, repeat=info.repeat, request=index, phase=req.phase,
                      prompt_tokens=len(req.tokens), hit_tokens=res.hit_tokens,
                      shared_tokens=shared * info.chunk, lookup_s=res.lookup_s,
                      store_s=res.store_s, store_done_s=res.store_done_s, load_s=res.load_s,
                      store_copy_s=res.store_copy_s, load_copy_s=res.load_copy_s,
                      store_span_s=res.store_span_s,
                      prefill_s=res.prefill_s, ttft_s=res.ttft_s, bytes_stored=res.bytes_stored,
                      bytes_loaded=res.bytes_loaded, verified_chunks=res.verified_chunks,
                      corrupt_chunks=res.corrupt_chunks, engine=req.engine, step=step, gpu=eng.gpu,
                      load_start_s=since(res.load_start, info.origin),
                      store_start_s=since(res.store_start, info.origin), tier=req.tier,
                      prefill_measured_s=res.prefill_measured_s, ttft_measured_s=res.ttft_measured_s,
                      adapter_s=res.adapter_s, forward_alone_s=res.forward_alone_s,
                      warm_pipeline_ratio=res.warm_pipeline_ratio, logits_max_abs_diff=res.logits_max_abs_diff,
                      logits_bitwise_equal=res.logits_bitwise_equal, oracle_pass=res.oracle_pass)


def align_barriers(plan: Plan, barrier) -> list:
    """Per phase, a barrier (`barrier(n)`: threading's or a multiprocessing context's) for its aligned
    requests, so that their transfers start together; None where fewer than two are aligned."""
    return [barrier(n) if (n := sum(1 for r in phase if r.align)) > 1 else None for phase in plan.phases]


def abort_all(barriers) -> None:
    """Break every barrier given (None: skipped): whoever waits at one stops instead of waiting on."""
    for b in barriers:
        if b is not None:
            b.abort()


def rank_overlap(plan: Plan, chunk: int) -> str:
    """Why one phase of `plan` lets two engines of one rank use the same chunk prefix ("" when none does):
    which of them stores it first would decide the other's hit."""
    ids = ExpectedHits(chunk, False, "all", "all")
    for step, phase in enumerate(plan.phases):
        seen: dict[tuple[int, bytes], Request] = {}
        for r in phase:
            for p in ids.prefixes(r.tokens):
                first = seen.setdefault((plan.ranks[r.engine], p), r)
                if first.engine != r.engine:
                    return (f"phase {step}: {first.name} (engine {first.engine}) and {r.name} (engine {r.engine}) of "
                            f"rank {plan.ranks[r.engine]} share a chunk prefix; their hits would depend on timing")
    return ""
