"""load_mode "layerwise" inside a real vLLM engine: the lookup, the pins and the GDN states load while the request
waits in WAITING_FOR_REMOTE_KVS, and the attention pages are copied in the step that first schedules it, each
attention layer waiting for its own (`wait_for_layer_load`). The model has two attention layers (8 layers, one in
four full attention), so a step's waits name both, in order.

As in test_engine_restore, vLLM's prefix cache is reset and its KV cache zeroed before every warm request: the
prefix can only come from hybridkv, and greedy tokens warm equal cold (up to a near-tie under another step layout,
`enginekit.departure`). On top, the attention blocks of every in-step load are digested right before its copies
start (they must not hold the server's bytes yet: nothing loaded them in the asynchronous phase) and once the step
ended them (they must, page for page)."""

from __future__ import annotations

import pytest
from enginekit import (
    ModelShape,
    close_llm,
    corrupt_stored,
    departure,
    departures,
    forget_local,
    generate,
    make_llm,
    prompt,
    unlike_stored,
    worker_counters,
    write_model,
)
from layerwise_probe import attention_layers, break_in_step_loads, take, watch
from layerwise_probe import check_in_step_loads as probe_check

BLOCK = 128  # the 8-layer hybrid's unified block on vLLM's CPU backend, as the 4-layer one's
LENGTHS = [129, 300, 511, 777, 1025, 1500, 2049]


def expected_hit(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model8(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hkv-layerwise") / "tiny8", ModelShape(layers=8))


@pytest.fixture(scope="module")
def lw_llm(model8, server):
    engine = make_llm(model8, server.endpoint, load_mode="layerwise")
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def stored(lw_llm):
    prompts = [prompt(n, seed=700 + i) for i, n in enumerate(LENGTHS)]
    cold = generate(lw_llm, prompts)
    assert all(g.cached == 0 for g in cold), [g.cached for g in cold]
    return prompts, cold


def check_in_step_loads(llm, endpoint: str, got: dict, n_loads: int) -> None:
    """`layerwise_probe.check_in_step_loads`, on this model's two attention layers."""
    assert len(attention_layers(llm)) == 2, attention_layers(llm)
    probe_check(llm, endpoint, got, n_loads)


def test_layerwise_warm_equals_cold_with_vllm_cache_zeroed(lw_llm, server, stored):
    prompts, cold = stored
    forget_local(lw_llm)
    watch(lw_llm)
    before = worker_counters(lw_llm)
    warm = generate(lw_llm, prompts)
    after = worker_counters(lw_llm)
    assert [g.cached for g in warm] == [expected_hit(len(p)) for p in prompts]
    got = take(lw_llm)
    check_in_step_loads(lw_llm, server.endpoint, got, len(prompts))
    # the blocks each request's first forward read its prefix from (attention and GDN state) are the server's
    reads = got["reads"]
    assert sorted(len(r.tokens) for r in reads) == sorted(g.cached for g in warm)
    assert not (bad := [(len(r.tokens), why) for r in reads if (why := unlike_stored(lw_llm, server.endpoint, r))])
    # the stats say the same: one in-step load per request, its layers' waits, the GDN states alone loaded before
    d = {k: after[k] - before[k] for k in after}
    assert d["step_loads"] == len(prompts) and d["loads"] == len(prompts) and d["load_failures"] == 0, d
    assert d["layer_waits"] == len(got["waits"]) > 0, d
    assert 0 < d["loaded_bytes"] < d["step_loaded_bytes"], d
    assert not (bad := departures(warm, cold)), f"{len(bad)} of {len(prompts)} differ warm vs cold: {bad[:3]}"


def test_layerwise_partial_hit_of_a_stored_prefix(lw_llm, server, stored):
    """Prompts sharing part of a stored prompt resume from the last whole block they share, loaded in-step."""
    prompts, _ = stored
    # each from another stored prompt: cases of one batch that shared a prefix could share vLLM's own blocks of it,
    # which then hold the server's bytes before the next case's in-step load (what the probe checks they do not)
    cases = [prompts[LENGTHS.index(1500)][:700] + prompt(300, seed=800),
             prompts[LENGTHS.index(2049)][:1030] + prompt(90, seed=801),
             prompts[LENGTHS.index(777)][:129] + prompt(60, 802)]
    forget_local(lw_llm)
    watch(lw_llm)
    warm = generate(lw_llm, cases)
    assert [g.cached for g in warm] == [640, 1024, 128]
    check_in_step_loads(lw_llm, server.endpoint, take(lw_llm), len(cases))
    recomputed = []
    for i, case in enumerate(cases):
        forget_local(lw_llm)
        (g,) = generate(lw_llm, [case], salts=[f"lw-recompute-{i}"])
        assert g.cached == 0
        recomputed.append(g)
    assert not (bad := departures(warm, recomputed)), bad


def test_layerwise_corrupted_attention_pages_change_the_output(lw_llm, server):
    """The negative control: wrong bytes in the stored attention objects, copied in the step, change the warm
    tokens, so the tests above can fail."""
    p = prompt(1400, seed=850)
    (cold,) = generate(lw_llm, [p])
    forget_local(lw_llm)
    assert corrupt_stored(lw_llm, server.endpoint, p[:expected_hit(len(p))], "attention") > 0
    before = worker_counters(lw_llm)["step_loads"]
    (warm,) = generate(lw_llm, [p])
    assert warm.cached == expected_hit(len(p))
    assert worker_counters(lw_llm)["step_loads"] == before + 1
    assert warm.tokens != cold.tokens, "corrupting the attention objects did not change the output"
    assert departure(warm, cold) is not None


def test_layerwise_new_engine_resumes_from_the_server(model8, server, lw_llm, stored):
    """A second engine process in load_mode layerwise resumes prompts it never computed: batched (the bytes read
    are the server's, the tokens continue the first engine's cold runs), then each alone, token for token against
    the same prompt recomputed alone in that engine."""
    prompts, cold = stored
    close_llm(lw_llm)  # one engine at a time on 2 cores
    fresh = make_llm(model8, server.endpoint, load_mode="layerwise")
    try:
        pick = [0, 3, 6]
        watch(fresh)
        warm = generate(fresh, [prompts[i] for i in pick])
        assert [g.cached for g in warm] == [expected_hit(len(prompts[i])) for i in pick]
        got = take(fresh)
        check_in_step_loads(fresh, server.endpoint, got, len(pick))
        assert not [why for r in got["reads"] if (why := unlike_stored(fresh, server.endpoint, r))]
        assert not (bad := departures(warm, [cold[i] for i in pick])), bad
        alone, recomputed = [], []
        for i in pick:
            forget_local(fresh)
            alone.append(generate(fresh, [prompts[i]])[0])
            forget_local(fresh)
            (g,) = generate(fresh, [prompts[i]], salts=[f"lw-fresh-{i}"])
            assert g.cached == 0
            recomputed.append(g.tokens)
        assert [g.cached for g in alone] == [expected_hit(len(prompts[i])) for i in pick]
        assert [g.tokens for g in alone] == recomputed
    finally:
        close_llm(fresh)


def test_layerwise_in_step_failure_stops_the_engine_instead_of_a_wrong_token(model8, server, stored):
    """What the fail-safe argument leaves: an in-step copy that cannot run (here the arena's connection is made to
    raise) cannot be handed back to vLLM as a recompute once the request left WAITING_FOR_REMOTE_KVS, so the step
    stops (StepLoadError) and vLLM's engine with it: the request gets an error, never a token computed over
    blocks the load did not write."""
    prompts, _ = stored
    engine = make_llm(model8, server.endpoint, load_mode="layerwise")
    try:
        break_in_step_loads(engine)
        forget_local(engine)
        with pytest.raises(Exception) as failed:
            generate(engine, [prompts[LENGTHS.index(777)]])
        assert type(failed.value).__name__ == "EngineDeadError", repr(failed.value)
    finally:
        close_llm(engine)
