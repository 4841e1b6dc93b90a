"""A real vLLM engine's output after a hybridkv hit equals recompute (greedy tokens, warm against cold).

Before every warm request vLLM's own prefix cache is reset and its KV cache zeroed, so the prefix can only come
from hybridkv: a GDN state or attention page that is not exactly what the forward reads changes the tokens
(the negative controls show it does). A request computed alone is compared token for token with the same
request recomputed alone. Batched, the blocks each request's first forward reads its prefix from are compared
byte for byte with the server's objects, and the tokens with `departure`: a batch's step layout (which requests
share a forward) depends on when each asynchronous load ends, and under another layout a near-tie of the
random-weight model's bfloat16 logits may go the other way (vLLM's own prefix cache does the same)."""

from __future__ import annotations

import pytest
from enginekit import (
    BLOCK,
    Generated,
    close_llm,
    corrupt_stored,
    departure,
    departures,
    external_hits,
    forget_local,
    generate,
    make_llm,
    prefix_reads,
    prompt,
    read_again,
    unlike_stored,
    watch_prefix_reads,
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


def test_warm_equals_cold_with_vllm_cache_zeroed(llm, server, stored):
    prompts, cold = stored
    forget_local(llm)
    before = external_hits(llm)
    watch_prefix_reads(llm)
    warm = generate(llm, prompts)  # one batch: its loads end in whichever steps they end
    assert [g.cached for g in warm] == [expected_hit(len(p)) for p in prompts]
    assert external_hits(llm) - before == sum(expected_hit(len(p)) for p in prompts)
    reads = prefix_reads(llm)
    assert sorted(len(r.tokens) for r in reads) == sorted(g.cached for g in warm)
    bad = [(len(r.tokens), why) for r in reads if (why := unlike_stored(llm, server.endpoint, r))]
    assert not bad, f"a batched request's forward read other bytes than the server holds: {bad}"
    bad = [(len(prompts[i]), why) for i, why in departures(warm, cold)]
    assert not bad, f"{len(bad)} of {len(prompts)} prompts differ warm vs cold: {bad[:3]}"


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
        recomputed.append(g)
    assert not (bad := departures(warm, recomputed)), bad  # batched against alone: another step layout


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
    # the same prompt and KV: batched or alone (another step layout), a near-tie at most may go another way
    assert not (bad := departures([a1, a2, b2], [cold[LENGTHS.index(1100)], a1, other])), bad


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
    assert departure(warm, cold) is not None, f"the batched tests' comparison takes the corrupted {kind} for a near-tie"


def test_departure_lets_only_a_near_tie_go_another_way():
    """`departure` on the numbers of the 777-token prompt's third token (cold: 275 and 472 tied at -3.69616;
    batched under another step layout: 472 one 1/64 above 275): that divergence is a near-tie; the same
    divergence where the recompute's margin is 0.08, a logprob 0.1 off before it, or fewer tokens are not."""
    def run(tokens, tops):
        return Generated(tokens, 768, tuple(tops))

    same = {274: -1.25, 9: -2.5}
    cold = run([274, 275, 136], [same, {275: -3.6961612701416016, 472: -3.6961612701416016}, {136: -0.5, 3: -4.0}])
    warm = run([274, 472, 473], [same, {472: -3.6815147399902344, 275: -3.6971397399902344}, {473: -0.7, 4: -3.0}])
    assert departure(warm, cold) is None and departure(cold, warm) is None and departure(cold, cold) is None
    wide = run(cold.tokens, [same, {275: -3.65, 472: -3.73}, cold.top[2]])  # each within 2**-4 of warm's
    assert "not a near-tie" in (departure(warm, wide) or "")
    drift = run(warm.tokens, [{274: -1.35, 9: -2.5}, *warm.top[1:]])
    assert "logprob of 274" in (departure(drift, cold) or "")
    assert "tokens" in (departure(run(warm.tokens[:2], warm.top[:2]), cold) or "")


def test_new_engine_resumes_from_the_server(model_dir, server, llm, stored):
    """A second engine process, never having computed these prompts, resumes them from the server. In one batch:
    every block each request's first forward reads its prefix from holds the server's bytes, and the tokens
    continue the same batch recomputed in that engine (under cache salts of their own) and the first engine's
    cold runs (`departure`). Then each prompt alone, token for token against the same prompt recomputed alone,
    whose last prefill step has the warm step's shape. (Batched, the step layout depends on when each load
    ends: on CI, with a core kept busy, the 777-token prompt once continued differently from the first
    engine's cold run from its third token, where its two likeliest tokens' logprobs are equal; a step that
    computes its last 9 tokens together with the 1500- and 2049-token prompts' moves one of them by 1/64, and
    vLLM's own prefix cache does the same under that layout, without the connector.)"""
    prompts, cold = stored
    close_llm(llm)  # one engine at a time on 2 cores; the module fixture's close is a no-op after this
    fresh = make_llm(model_dir, server.endpoint)
    try:
        pick = [0, 3, 7, 12, 18, 21]
        batch = [prompts[i] for i in pick]
        watch_prefix_reads(fresh)
        warm = generate(fresh, batch)
        assert [g.cached for g in warm] == [expected_hit(len(p)) for p in batch]
        # byte for byte, whatever the step layout: every block each request's first forward read its prefix from
        # (attention pages, the GDN state) holds the server's object of that chunk
        reads = prefix_reads(fresh)
        assert sorted(len(r.tokens) for r in reads) == sorted(g.cached for g in warm)
        bad = [(len(r.tokens), why) for r in reads if (why := unlike_stored(fresh, server.endpoint, r))]
        assert not bad, f"a batched request's forward read other bytes than the server holds: {bad}"
        forget_local(fresh)
        assert unlike_stored(fresh, server.endpoint, read_again(fresh, reads[0])), "zeroed blocks pass the check"
        again = generate(fresh, batch, salts=[f"fresh-batch-{i}" for i in pick])
        assert all(g.cached == 0 for g in again), [g.cached for g in again]
        assert not (bad := departures(warm, again)), f"warm batch against the batch recomputed: {bad}"
        assert not (bad := departures(warm, [cold[i] for i in pick])), f"against the first engine's cold runs: {bad}"
        alone = []
        for i in pick:
            forget_local(fresh)
            alone.append(generate(fresh, [prompts[i]])[0])
        assert [g.cached for g in alone] == [expected_hit(len(prompts[i])) for i in pick]
        recomputed = []
        for i in pick:
            forget_local(fresh)
            (g,) = generate(fresh, [prompts[i]], salts=[f"fresh-recompute-{i}"])
            assert g.cached == 0
            recomputed.append(g.tokens)
        assert [g.tokens for g in alone] == recomputed
    finally:
        close_llm(fresh)
