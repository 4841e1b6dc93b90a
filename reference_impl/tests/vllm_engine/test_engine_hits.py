"""Every hit hybrid traffic could have, with vLLM's default settings (its step budget, its default
`--prefix-cache-retention-interval`): a request that shares whole blocks with a stored prompt resumes at the last
block they share, wherever the two part ways (one document, many questions; a shared system prompt), and a chat
turn resumes through the previous turn's answer. vLLM keeps a GDN state only where a scheduler step ends, and by
default only at the prompt's last block boundary; the connector asks it for one at every block
(`hybridkv.engine.vllm.checkpoints`). The resumed requests run in a new engine, and their greedy tokens are the
same requests' recomputed there."""

from __future__ import annotations

import pytest
from enginekit import BLOCK, close_llm, departures, engine_args, forget_local, generate, prompt, worker_counters

# three engines, 100,000 tokens of prefill: 3.5 minutes on 2 loaded cores, past the suite's 300 s limit when busier
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STORED = 3000  # tokens of each stored prompt (its last whole block ends at 2944)
TAIL = 400  # the tokens of a diverging request after the part it shares
# where each diverging request leaves its stored prompt: on and off block boundaries, from its first token to its
# last
KEEP = [1, 127, 128, 129, 255, 300, 512, 700, 1000, 1024, 1300, 1600, 1900, 2048, 2300, 2600, 2944, 2999]
TURN1, ANSWER, TURN2 = 1100, 300, 50  # chat: turn 1's prompt, its answer, what the user adds in turn 2


def default_llm(model_dir, endpoint: str):
    """An engine with the connector at its defaults and vLLM's own defaults for the step budget and the state
    retention (the other tests choose a state at every block boundary themselves)."""
    from vllm import LLM

    args = engine_args(model_dir, endpoint)
    del args["max_num_batched_tokens"], args["prefix_cache_retention_interval"]
    return LLM(**args)


def test_divergent_prompts_and_chat_turns_resume_at_their_last_shared_block(model_dir, serve):
    # a state at every block of 18 prompts of 3,000 tokens is 0.43 GB with the tiny model: an L1 that holds them
    # all (the default test server's 0.25 GiB evicts the first prompts' chunks, and a hit needs every one)
    server = serve(name="hits", l1_gib=1.0)
    stored = [prompt(STORED, seed=i) for i in range(len(KEEP))]
    diverging = [p[:n] + prompt(TAIL, seed=1000 + i) for i, (p, n) in enumerate(zip(stored, KEEP, strict=True))]
    turn1 = prompt(TURN1, seed=500)
    first = default_llm(model_dir, server.endpoint)
    try:
        assert first.llm_engine.vllm_config.cache_config.prefix_cache_retention_interval == 0  # vLLM's default
        generate(first, stored, max_tokens=1)
        (answer,) = generate(first, [turn1], max_tokens=ANSWER)
        forget_local(first)  # waits until every store is committed
        stored_bytes = worker_counters(first)["stored_bytes"]
    finally:
        close_llm(first)
    assert stored_bytes > 0
    turn2 = turn1 + answer.tokens + prompt(TURN2, seed=501)
    fresh = default_llm(model_dir, server.endpoint)
    try:
        warm = generate(fresh, diverging)
        (chat,) = generate(fresh, [turn2])
        forget_local(fresh)
        again = generate(fresh, diverging, salts=[f"recompute-{i}" for i in range(len(diverging))])
        forget_local(fresh)
        (chat_again,) = generate(fresh, [turn2], salts=["recompute-chat"])
    finally:
        close_llm(fresh)
    shared = [n // BLOCK * BLOCK for n in KEEP]  # the whole blocks each shares with what was stored
    assert [g.cached for g in warm] == shared, f"hit {sum(g.cached for g in warm)} of {sum(shared)} shared tokens"
    assert all(g.cached == 0 for g in again) and chat_again.cached == 0
    assert not (bad := departures(warm, again)), f"warm against recomputed: {bad}"
    # turn 1 computed its prompt and all but the last token of its answer: the last whole block of those
    assert chat.cached == (TURN1 + ANSWER - 1) // BLOCK * BLOCK > TURN1 // BLOCK * BLOCK
    assert not (bad := departures([chat], [chat_again])), f"chat turn 2 against recomputed: {bad}"
