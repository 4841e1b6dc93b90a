"""A real vLLM engine's output after a hybridkv hit equals recompute (greedy tokens, warm against cold).

Before every warm request vLLM's own prefix cache is reset and its KV cache zeroed, so the prefix can only come
from hybridkv: a GDN state or attention page that is not exactly what the forward reads changes the tokens
(the negative controls show it does)."""

from __future__ import annotations

import pytest
from enginekit import (
    BLOCK,
    close_llm,
    corrupt_stored,
    external_hits,
    forget_local,
    generate,
    make_llm,
    prompt,
)


def expected_hit(n: int) -> int:
    """What a warm request of an n-token prompt resumes from: whole blocks, at most n-1 tokens."""
    return (n - 1) // BLOCK * BLOCK


LENGTHS = [129, 200, 255, 256, 257, 300, 383, 450, 511, 513, 600, 640, 777, 900, 1023, 1025, 1100, 1300, 1500,
           1700, 2000, 2049]


@pytest.fixture(scope="module")
def stored(llm):
    """Cold runs of prompts of many lengths (none a multiple of the block but two), in two batches: their
    tokens, stored in hybridkv by the connector."""
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    half = len(prompts) // 2
    cold = generate(llm, prompts[:half]) + generate(llm, prompts[half:])
    assert all(g.cached == 0 for g in cold), [g.cached for g in cold]
    return prompts, cold


def test_warm_equals_cold_with_vllm_cache_zeroed(llm, stored):
    prompts, cold = stored
    forget_local(llm)
    before = external_hits(llm)
    warm = generate(llm, prompts)  # one batch: every load in the same steps
    assert [g.cached for g in warm] == [expected_hit(len(p)) for p in prompts]
    assert external_hits(llm) - before == sum(expected_hit(len(p)) for p in prompts)
    mismatches = [(len(p), c.tokens, w.tokens) for p, c, w in zip(prompts, cold, warm, strict=True)
                  if c.tokens != w.tokens]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ warm vs cold: {mismatches[:3]}"


def test_partial_hit_of_a_stored_prefix(llm, stored):
    """A prompt sharing only part of a stored prompt resumes from the last whole block they share."""
    prompts, _ = stored
    base = prompts[LENGTHS.index(1500)]
    cases = [base[:700] + prompt(300, seed=100), base[:1030] + prompt(90, seed=101), base[:129] + prompt(60, 102)]
    forget_local(llm)
    warm = generate(llm, cases)
    assert [g.cached for g in warm] == [640, 1024, 128]
    # recompute: each prompt alone under a cache_salt of its own (nothing stored under it), vLLM's cache dropped
    recomputed = []
    for i, case in enumerate(cases):
        forget_local(llm)
        (g,) = generate(llm, [case], salts=[f"recompute-{i}"])
        assert g.cached == 0
        recomputed.append(g.tokens)
    assert [g.tokens for g in warm] == recomputed


def test_cache_salt_keeps_tenants_apart(llm, stored):
    prompts, cold = stored
    p = prompts[LENGTHS.index(1100)]
    forget_local(llm)
    other = generate(llm, [p], salts=["tenant-b"])[0]
    assert other.cached == 0, "a request under another cache_salt resumed from the unsalted tenant's KV"
    forget_local(llm)
    a1 = generate(llm, [p], salts=["tenant-a"])[0]
    assert a1.cached == 0
    forget_local(llm)
    a2, b2 = generate(llm, [p, p], salts=["tenant-a", "tenant-b"])
    assert a2.cached == expected_hit(len(p)) and b2.cached == expected_hit(len(p))  # each its own store
    assert a2.tokens == a1.tokens == cold[LENGTHS.index(1100)].tokens
    assert b2.tokens == other.tokens


@pytest.mark.parametrize("kind", ["attention", "recurrent"])
def test_corrupted_pages_change_the_output(llm, server, kind):
    """The negative control: wrong bytes in one group kind's stored objects change the warm tokens, so the
    tests above can fail."""
    p = prompt(1400, seed=500 + len(kind))
    cold = generate(llm, [p])[0]
    forget_local(llm)
    assert corrupt_stored(llm, server.endpoint, p[:expected_hit(len(p))], kind) > 0
    warm = generate(llm, [p])[0]
    assert warm.cached == expected_hit(len(p))
    assert warm.tokens != cold.tokens, f"corrupting the {kind} objects did not change the output"


def test_new_engine_resumes_from_the_server(model_dir, server, llm, stored):
    """A second engine process, never having computed these prompts, resumes them from the server: each prompt
    alone, against the same prompt recomputed alone in that engine (under a cache_salt of its own). Alone, the
    warm continuation's last step has the shape of the recompute's last prefill step; a batch's step
    composition depends on when each async load ends, and on CI (a core kept busy) one of six batched prompts
    once continued differently from the first engine's cold run from its third token on (2026-12-02), as a
    near-tie of a random-weight model's logits would under another step layout."""
    prompts, _ = stored
    close_llm(llm)  # one engine at a time on 2 cores; the module fixture's close is a no-op after this
    fresh = make_llm(model_dir, server.endpoint)
    try:
        pick = [0, 3, 7, 12, 18, 21]
        warm = [generate(fresh, [prompts[i]])[0] for i in pick]
        assert [g.cached for g in warm] == [expected_hit(len(prompts[i])) for i in pick]
        recomputed = []
        for i in pick:
            forget_local(fresh)
            (g,) = generate(fresh, [prompts[i]], salts=[f"fresh-recompute-{i}"])
            assert g.cached == 0
            recomputed.append(g.tokens)
        assert [g.tokens for g in warm] == recomputed
    finally:
        close_llm(fresh)
