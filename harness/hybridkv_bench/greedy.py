"""Whether one greedy continuation is another's, computed under another step layout (a hit that resumes a prompt
prefills it in other steps than its recompute): the same tokens with the same logprobs, up to where both part at
a near-tie. The real-engine tests and `hybridkv vllm-replay` judge a warm request against its recompute with it."""

from __future__ import annotations

from typing import Protocol

# The tiny model's logits are bfloat16, and two tokens' logits are often exactly equal (in one run here, of the
# 264 greedy steps of the restore tests' 22 prompts, 9 were exact ties and 36 within NEAR_TIE). A step that
# batches a request's tokens with other requests' tokens (another step layout: which requests share a forward
# depends, with asynchronous loads, on when each load ends) moves a logit by a unit in the last place, 1/64
# for logits in [2, 4): vLLM alone, without the connector, continues the same prompt differently under two
# layouts from its own prefix cache (results/cpu/2026-12-02/batched_ties).
NEAR_TIE = 2.0**-4


class Continuation(Protocol):
    """Greedy tokens with, per token, the logprobs of the likeliest few (vLLM's `logprobs=2`)."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def top(self) -> tuple[dict[int, float], ...]: ...


def departure(got: Continuation, ref: Continuation, tol: float = NEAR_TIE) -> str | None:
    """Why `got` is not `ref`'s continuation computed under another step layout, or None when it is: the same
    tokens, with the logprobs both report within `tol`, up to the end or up to a position where the two took
    different tokens that are a near-tie in both (top two within `tol`: each run's argmax of two equal logits
    can go either way; past it the contexts differ, so nothing later is compared). KV that is not what the
    forward would have computed moves logprobs by far more than `tol` (`test_corrupted_pages_change_the_output`)."""
    if len(got.tokens) != len(ref.tokens) or len(got.top) != len(got.tokens) or len(ref.top) != len(ref.tokens):
        return f"{len(got.tokens)} tokens ({len(got.top)} with logprobs) against {len(ref.tokens)} ({len(ref.top)})"
    for pos, (g, r, gl, rl) in enumerate(zip(got.tokens, ref.tokens, got.top, ref.top, strict=True)):
        for t in gl.keys() & rl.keys():
            if abs(gl[t] - rl[t]) > tol:
                return f"at token {pos} the logprob of {t} is {gl[t]:.5f}, recomputed {rl[t]:.5f}"
        if g != r:
            if r in gl and g in rl and gl[g] - gl[r] <= tol and rl[r] - rl[g] <= tol:
                return None
            return (f"at token {pos} {g} (logprobs {gl}) where the recompute took {r} ({rl}): not a near-tie "
                    f"within {tol:g}")
    return None
