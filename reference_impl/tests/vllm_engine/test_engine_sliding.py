"""Sliding-window attention in a real vLLM engine: a tiny random-weight Gemma 3 text model (three sliding-window
layers of 124 tokens, one full-attention layer), whose sliding layers vLLM's hybrid manager serves in groups of
their own, freeing every block that falls out of the window.

hybridkv stores, per chunk, the blocks of it a later resume can need (its last ceil(99 / 32) = 4 blocks, all of a
chunk of 96 tokens) and loads only the blocks vLLM holds for the hit: those covering its last 99 tokens. With
96-token chunks the window reaches into the tail of the chunk before the last one, so a load leaves the rest of
that chunk's object unwritten (holes). Before every warm request vLLM's own prefix cache is reset and its KV cache
zeroed, so a block hybridkv should have written and did not, or wrote wrong, changes the tokens: the negative
controls show it does, and that the bytes of the blocks outside the window are never read."""

from __future__ import annotations

import pytest
from enginekit import (
    close_llm,
    connector_layout,
    corrupt_stored_pages,
    engine_args,
    external_hits,
    forget_local,
    generate,
    prompt,
    server_settled,
    worker_counters,
    write_gemma3_model,
)

WINDOW = 124  # not a multiple of the block: a resume needs the last 123 tokens' KV, in 4 blocks
BLOCK = 32
CHUNK = 96  # 3 blocks: shorter than the window, so a resume reads the tails of two chunks, the first one in part
WIDE_CHUNK = 256  # 8 blocks: longer than the window, so each chunk stores its last 4 blocks only
LENGTHS = [97, 150, 191, 192, 193, 300, 457, 700, 1000, 1400, 2000]
MAX_TOKENS = 24


def expected_hit(n: int, chunk: int = CHUNK) -> int:
    """Whole chunks, at most n - 1 tokens."""
    return (n - 1) // chunk * chunk


def make_engine(model, endpoint: str, chunk: int):
    from vllm import LLM

    args = engine_args(model, endpoint, chunk_tokens=chunk)
    args.update(block_size=BLOCK, prefix_cache_retention_interval=CHUNK * 4)
    return LLM(**args)


@pytest.fixture(scope="module")
def gemma(model_dir):
    return write_gemma3_model(model_dir.parent / "gemma3-sliding", WINDOW)


@pytest.fixture(scope="module")
def llm(gemma, server):
    engine = make_engine(gemma, server.endpoint, CHUNK)
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def stored(llm):
    """Cold runs of prompts of 1 to 20 windows: their tokens, stored in hybridkv by the connector."""
    prompts = [prompt(n, seed=700 + i) for i, n in enumerate(LENGTHS)]
    cold = generate(llm, prompts, MAX_TOKENS)
    assert all(g.cached == 0 for g in cold), [g.cached for g in cold]
    return prompts, cold


def test_vllm_gives_the_sliding_layers_groups_of_their_own(llm):
    layout, chunk = connector_layout(llm)
    assert chunk == CHUNK
    assert [(g.kind, g.window, g.block_tokens) for g in layout.groups] == [("sliding", WINDOW, BLOCK)] * 3 + [
        ("attention", 0, BLOCK)]
    assert [g.tail_blocks(CHUNK) for g in layout.groups] == [3, 3, 3, 3]


def test_warm_equals_cold_with_vllm_cache_zeroed(llm, stored):
    """Every prompt resumes from hybridkv (one batch: every load in the same steps, vLLM counting the hits), and
    gives, alone, the tokens of the same request recomputed alone: a batch is scheduled in prefill steps that
    depend on when each load ends, and bf16 sums in another order can flip a late greedy token, so tokens are
    compared between runs of one request each."""
    prompts, _ = stored
    forget_local(llm)
    before = external_hits(llm)
    warm = generate(llm, prompts, MAX_TOKENS)
    assert [g.cached for g in warm] == [expected_hit(len(p)) for p in prompts]
    assert external_hits(llm) - before == sum(expected_hit(len(p)) for p in prompts)
    mismatches = []
    for i, p in enumerate(prompts):
        forget_local(llm)
        (alone,) = generate(llm, [p], MAX_TOKENS)
        (recomputed,) = generate(llm, [p], MAX_TOKENS, salts=[f"recompute-{i}"])  # nothing stored under it
        assert (alone.cached, recomputed.cached) == (expected_hit(len(p)), 0)
        if alone.tokens != recomputed.tokens:
            mismatches.append((len(p), recomputed.tokens, alone.tokens))
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ warm vs cold: {mismatches[:3]}"


def test_only_the_blocks_in_the_window_are_loaded(llm, server, stored):
    """A 1400-token prompt resumes at 1344 tokens (14 chunks): vLLM holds the sliding layers' KV of tokens
    1221.. only, blocks 38-41, the last block of chunk 12's tail and all of chunk 13's. Changing the stored bytes
    of the other two blocks of chunk 12's tail (holes of the load) changes nothing; changing those of block 38
    changes the tokens. Each warm run is compared with the same request recomputed alone (a batch of one is
    scheduled in other prefill steps than the cold batch, and bf16 sums in another order can flip a late token)."""
    prompts, _ = stored
    p, hit = prompts[LENGTHS.index(1400)], expected_hit(1400)
    first = (hit - WINDOW + 1) // BLOCK  # 38: the first block vLLM keeps
    assert (first, first // 3) == (38, 12)
    forget_local(llm)
    (recompute,) = generate(llm, [p], MAX_TOKENS, salts=["recompute-sliding"])  # nothing stored under that salt
    assert recompute.cached == 0

    def chunk12(js, groups):
        return lambda layout, chunk, o: js if o.chunk == 12 and o.group in groups else None

    assert corrupt_stored_pages(llm, server.endpoint, p[:hit], chunk12([0, 1], {0, 1, 2})) == 3
    forget_local(llm)
    loads = worker_counters(llm)
    (warm,) = generate(llm, [p], MAX_TOKENS)
    after = worker_counters(llm)
    assert warm.cached == hit and warm.tokens == recompute.tokens
    # what was written: 42 attention blocks, and 4 blocks in each of the 3 sliding layers (of the 18 blocks of
    # their 6 objects the lookup handed out, and the 126 a full-attention group would have taken)
    layout, _ = connector_layout(llm)
    page = layout.groups[0].page_bytes
    assert after["loads"] - loads["loads"] == 1
    assert after["loaded_bytes"] - loads["loaded_bytes"] == (hit // BLOCK + 3 * 4) * page

    assert corrupt_stored_pages(llm, server.endpoint, p[:hit], chunk12([2], {0, 1, 2})) == 3
    forget_local(llm)
    (bad,) = generate(llm, [p], MAX_TOKENS)
    assert bad.cached == hit
    assert bad.tokens != recompute.tokens, "changing the one in-window block of chunk 12 did not change the output"


def test_a_chunk_wider_than_the_window_stores_its_last_blocks_only(gemma, serve, llm):
    """With 256-token chunks each chunk's object of a sliding layer holds its last 4 of 8 blocks (what a resume
    at the chunk's end or later can read); the hits still give recompute's tokens."""
    close_llm(llm)  # one engine at a time on 2 cores; the module fixture's close is a no-op after this
    srv = serve(name="sliding-wide")
    wide = make_engine(gemma, srv.endpoint, WIDE_CHUNK)
    try:
        layout, chunk = connector_layout(wide)
        assert chunk == WIDE_CHUNK and [g.tail_blocks(chunk) for g in layout.groups] == [4, 4, 4, 8]
        page = layout.groups[0].page_bytes
        prompts = [prompt(n, seed=800 + i) for i, n in enumerate([300, 700, 1300, 2100])]
        generate(wide, prompts, MAX_TOKENS)
        counters = server_settled(srv.endpoint)
        # chunks of the prompt and the generated tokens whose KV was computed (all but the last token's)
        chunks = sum((len(p) + MAX_TOKENS - 1) // WIDE_CHUNK for p in prompts)
        per_chunk = 3 * 4 * page + 8 * page  # three sliding objects of 4 blocks, the attention object of 8
        assert counters["objects_committed"] == 4 * chunks
        assert counters["bytes_committed"] == chunks * per_chunk == chunks * 20 * page  # full attention: 32 pages
        assert worker_counters(wide)["stored_bytes"] == chunks * per_chunk
        for i, p in enumerate(prompts):  # each alone against itself recomputed alone (see the test above)
            forget_local(wide)
            (alone,) = generate(wide, [p], MAX_TOKENS)
            (recomputed,) = generate(wide, [p], MAX_TOKENS, salts=[f"recompute-{i}"])
            assert (alone.cached, recomputed.cached) == (expected_hit(len(p), WIDE_CHUNK), 0)
            assert alone.tokens == recomputed.tokens, len(p)
    finally:
        close_llm(wide)
