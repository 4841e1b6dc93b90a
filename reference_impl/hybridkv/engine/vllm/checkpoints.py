"""Where the connector asks vLLM to keep GDN states, so a later request resumes at the last block it shares.

vLLM (align mode) writes a request's GDN state into a block of its own only where a scheduler step ends on a block
boundary, and by default (`--prefix-cache-retention-interval 0`) keeps only the prompt's last boundary and a
*shared-prefix junction* (`Request.shared_prefix_boundary`, which its own prefix cache sets where it found
attention blocks past the last state). At that junction vLLM's scheduler ends the prefill step
(`Scheduler._mamba_block_aligned_split`) and its Mamba manager keeps the state (`reachable_block_mask`), offering
it to the connector (`boundary_state_offloads`). Without more, a request that diverges from a stored prompt
anywhere before that prompt's last block finds no state to resume from, and a chat turn finds none in the
previous answer (decode states are never kept).

So the scheduler side moves the junction: before each step it names the next boundary of the request's grid
(every `state_every_chunks` chunks of the prompt, every chunk of the answer) as the junction, and vLLM ends the
step there and keeps the state. A junction vLLM itself set (its own prefix cache's) is kept until the request passed
it. The cost: a prefill step per kept state of the prompt (the step budget is still filled by other requests), a
state object per kept boundary (the bytes `state_every_chunks` trades against hits)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


def next_boundary(done: int, every_tokens: int) -> int:
    """The first boundary of the grid strictly past `done` computed tokens."""
    return (done // every_tokens + 1) * every_tokens


def ask_for_state(request: Request, done: int, every_tokens: int, nearer: bool = False) -> None:
    """Ask vLLM to end a step, and keep the GDN state, at the grid's next boundary past `done` tokens (what the
    request will have computed when its next step starts). A junction still ahead stays (vLLM's own prefix cache
    may have set it) and the grid's boundary is asked for once the request passed it; with `nearer` (decode,
    where the grid is finer than the prompt's and vLLM sets no junction) one farther than the grid's is moved in."""
    if every_tokens <= 0:
        return
    want = next_boundary(done, every_tokens)
    junction = getattr(request, "shared_prefix_boundary", 0)
    if junction > done and not (nearer and junction > want):
        return
    request.shared_prefix_boundary = want
