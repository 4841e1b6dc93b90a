"""What a replay records: one request's line (`Replayed`), a workload's figures (`summary`) and why it failed
(`failure`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Replayed:
    """One request of one workload: a line of replay.csv."""

    workload: str
    kind: str
    request: int
    prompt_tokens: int
    shared_tokens: int
    hit_tokens: int
    vllm_shared_tokens: int  # shared with what the `vllm` engine computed (its own answers)
    vllm_hit_tokens: int
    ttft_cold_s: float
    ttft_hybridkv_s: float
    ttft_vllm_s: float
    tokens_equal: bool       # hybridkv's greedy tokens == the recompute's
    vllm_tokens_equal: bool  # vLLM's own hit's greedy tokens == the recompute's
    # why hybridkv's (vLLM's own hit's) continuation is not the recompute's (`greedy.departure`): "" when the
    # tokens are equal, or part only where both runs' two likeliest tokens were a near-tie
    departure: str = ""
    vllm_departure: str = ""


def _p50(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def summary(rows: list[Replayed]) -> dict[str, float | int | None]:
    """A workload's figures: hit share both ways over its requests, TTFT p50 of the requests that share blocks
    with what came before (the first request has nothing to hit)."""
    shared, vllm_shared = sum(r.shared_tokens for r in rows), sum(r.vllm_shared_tokens for r in rows)
    hit, own = sum(r.hit_tokens for r in rows), sum(r.vllm_hit_tokens for r in rows)
    warm = [r for r in rows if r.shared_tokens]
    m: dict[str, float | int | None] = {
        "requests": len(rows), "warm_requests": len(warm), "shared_tokens": shared, "hit_tokens": hit,
        "vllm_shared_tokens": vllm_shared, "vllm_hit_tokens": own, "hit_share": hit / shared if shared else None,
        "vllm_hit_share": own / vllm_shared if vllm_shared else None,
        "hits_past_shared": sum(r.hit_tokens > r.shared_tokens for r in rows),
        "ttft_cold_s": _p50([r.ttft_cold_s for r in warm]),
        "ttft_warm_s": _p50([r.ttft_hybridkv_s for r in warm]),
        "ttft_warm_vllm_s": _p50([r.ttft_vllm_s for r in warm]),
        "tokens_equal": int(all(r.tokens_equal for r in rows)),
        "vllm_tokens_equal": int(all(r.vllm_tokens_equal for r in rows)),
        "departures": sum(bool(r.departure) for r in rows),
        "vllm_departures": sum(bool(r.vllm_departure) for r in rows),
    }
    warm_s, own_s, cold_s = m["ttft_warm_s"], m["ttft_warm_vllm_s"], m["ttft_cold_s"]
    m["warm_vs_vllm_ratio"] = warm_s / own_s if warm_s and own_s else None
    m["cold_vs_warm"] = cold_s / warm_s if warm_s and cold_s else None
    return m


def failure(rows: list[Replayed]) -> str | None:
    """Why a workload failed, or None."""
    why = [f"request {r.request}: hit {r.hit_tokens} tokens past the {r.shared_tokens} it shares"
           for r in rows if r.hit_tokens > r.shared_tokens]
    why += [f"request {r.request}: through hybridkv not the recompute's continuation, {r.departure}"
            for r in rows if r.departure]
    return "; ".join(why) or None
