"""GDN states at every block boundary with vLLM's default retention and a step budget of many blocks
(`hybridkv.engine.vllm.checkpoints`): vLLM 0.33's scheduler ends a step at each block the connector asks for and
offers its state, so a request that parts from a stored prompt anywhere resumes at the last block they share."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from vllmkit import C, run, sched_stats, settle, tokens, worker_stats

STEP = 8 * C  # a step budget of 8 blocks: without the connector's asks, a state only where a step ends


def diverge(eng, a: list[int], keep: list[int]) -> list[int]:
    """The hits of requests that keep `keep` tokens of `a` and go on with 100 of their own, each alone."""
    hits = []
    for i, n in enumerate(keep):
        eng.add_request(f"B{i}", a[:n] + tokens(100, 100 + i))
        so, _ = eng.step_until_scheduled()
        hits.append(so.scheduled_new_reqs[0].num_computed_tokens)
        assert eng.run().corrupt_pages == 0
        settle(eng)
    return hits


KEEP = [1, C - 1, C, C + 1, 3 * C + 40, 5 * C, 7 * C + 79, 9 * C + 3]


def test_a_state_at_every_block_resumes_diverging_requests_at_the_last_shared_block(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, step_tokens=STEP, retention=0)  # vLLM's default retention
    a = tokens(10 * C + 17, 0)
    assert run(eng, "A", a).corrupt_pages == 0
    # a step ended at each of the 10 whole blocks, and vLLM offered its state: a store each
    assert worker_stats(eng).stores == 10 and worker_stats(eng).store_failures == 0
    settle(eng)
    assert diverge(eng, a, KEEP) == [n // C * C for n in KEEP]
    assert sched_stats(eng).hit_tokens == sum(n // C * C for n in KEEP)


def test_every_fourth_block_and_off(serve, make_engine):
    """`state_every_chunks` 4: a state at every fourth block (and the prompt's last), hits there; 0: only
    where vLLM keeps one itself, the prompt's last block boundary (what the connector did before)."""
    srv = serve()
    a = tokens(10 * C + 17, 0)
    sparse = make_engine(srv.endpoint, step_tokens=STEP, retention=0, state_every_chunks=4, salt="every-4")
    run(sparse, "A", a)
    assert worker_stats(sparse).stores == 3  # blocks 4, 8, and the prompt's last (10)
    settle(sparse)
    assert diverge(sparse, a, KEEP) == [min(n // C // 4 * 4 * C, 10 * C) for n in KEEP]
    off = make_engine(srv.endpoint, step_tokens=STEP, retention=0, state_every_chunks=0, salt="off")
    run(off, "A", a)
    assert worker_stats(off).stores == 1
    settle(off)
    assert diverge(off, a, KEEP) == [0] * len(KEEP)


def test_decode_keeps_a_state_at_every_chunk_whatever_the_prefill_grid(serve, make_engine):
    """With `state_every_chunks` 4 the prompt keeps a state every fourth block, but the answer one at each block
    it completes (decode ends a step at every token anyway), so the next chat turn resumes at the answer's last
    whole block."""
    srv = serve()
    eng = make_engine(srv.endpoint, step_tokens=STEP, retention=0, state_every_chunks=4, salt="decode")
    eng.add_request("A", tokens(4 * C + 17, 0), max_tokens=3 * C)  # prompt and answer reach 7 blocks and 17 tokens
    assert eng.run().corrupt_pages == 0
    # block 4 (the prompt's grid and its last whole block), then 5, 6 and 7 while decoding
    assert worker_stats(eng).stores == 4 and worker_stats(eng).store_failures == 0
