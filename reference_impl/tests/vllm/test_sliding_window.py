"""Sliding-window groups end to end with vLLM 0.33's real scheduler, KV-cache manager and SlidingWindowManager (a
Gemma 3 text config: three sliding-window layers of 100 tokens, one full-attention layer; 16-token blocks) and a
simulated forward: what vLLM frees and which blocks it hands the connector are vLLM's own doing, and every page a
load writes is checked against what the forward wrote.

A resume at t tokens needs the KV of tokens t - 99 .. t - 1 in the sliding layers: vLLM keeps blocks
(t - 99) // 16 .. t / 16 - 1 and nulls the rest. Chunks of 16 tokens (one block), 48 (three: the window reaches
part of a chunk's tail, so the load leaves the rest unwritten) and 128 (eight: each chunk stores its last 7)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.vllm.plan import LoadJob, LoadRefused, load_block_ids
from hybridkv_bench import vllm_offline as offline
from hybridkv_bench import vllm_planning as planning
from hybridkv_kernels import HOLE
from vllmkit import run, sched_stats, settle, tokens, worker_stats

SHAPE = planning.TINY_SLIDING
WINDOW, BLOCK = SHAPE.sliding_window, 16
PAGE = 2 * SHAPE.num_kv_heads * SHAPE.head_dim * 2 * BLOCK  # K and V of 16 tokens, bf16
HIT = 768  # a multiple of every chunk size below


@pytest.fixture(scope="module")
def sliding_model(model_dir):
    return planning.model_config(planning.write_sliding_config(SHAPE, model_dir / "tiny-sliding"), max_model_len=4096)


def kept_by_vllm(t: int) -> list[int]:
    """The blocks of a sliding layer vLLM holds at t computed tokens."""
    return list(range(max(0, t - WINDOW + 1) // BLOCK, t // BLOCK))


@pytest.mark.parametrize("chunk", [16, 48, 128])
def test_a_hit_loads_exactly_the_blocks_vllm_keeps(serve, make_engine, sliding_model, chunk):
    srv = serve()
    eng = make_engine(srv.endpoint, model=sliding_model, chunk_tokens=chunk, num_blocks=512)
    layout = eng.layout
    assert [(g.kind, g.window) for g in layout.groups] == [("sliding", WINDOW)] * 3 + [("attention", 0)]
    a = tokens(1000, 20)
    assert run(eng, "A", a).corrupt_pages == 0
    # every chunk stored in the step that computed it, each sliding object its chunk's last min(bpc, 7) blocks
    tail = min(chunk // BLOCK, 7)
    assert [g.tail_blocks(chunk) for g in layout.groups] == [tail] * 3 + [chunk // BLOCK]
    assert worker_stats(eng).stored_bytes == 1000 // chunk * (3 * tail + chunk // BLOCK) * PAGE
    settle(eng)
    eng.add_request("B", a[:HIT] + tokens(60, 21))
    so, rep = eng.step_until_scheduled()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == HIT and sched_stats(eng).hit_tokens == HIT
    # vLLM's own rule: in each sliding group it holds blocks 41..47 (tokens 656..767) of the hit, null before them
    for g in layout.sliding_groups:
        assert [j for j, b in enumerate(new.block_ids[g][:HIT // BLOCK]) if b != 0] == kept_by_vllm(HIT)
    # every page vLLM reads was loaded and is right: 48 attention pages, 7 per sliding layer
    assert (rep.verified_pages, rep.corrupt_pages) == (HIT // BLOCK + 3 * 7, 0)
    assert worker_stats(eng).loaded_bytes == (HIT // BLOCK + 3 * 7) * PAGE
    assert eng.zeroed_blocks == HIT // BLOCK + 3 * 7  # the blocks the load was to write, zeroed before it
    # the check can fail: two of the sliding layer's blocks swapped
    wrong = [list(ids) for ids in new.block_ids]
    g = layout.sliding_groups[0]
    wrong[g][41], wrong[g][47] = wrong[g][47], wrong[g][41]
    bad = offline.StepReport()
    eng.verify("B", tuple(wrong), HIT, bad)
    assert bad.corrupt_pages == 2
    assert eng.run().corrupt_pages == 0
    assert worker_stats(eng).loads == 1 and worker_stats(eng).load_failures == 0


def test_local_prefix_hit_plus_external_hit(serve, make_engine, sliding_model):
    srv = serve()
    eng = make_engine(srv.endpoint, model=sliding_model, chunk_tokens=48, num_blocks=512)
    a = tokens(1000, 22)
    run(eng, "A", a)
    settle(eng)
    run(eng, "C", a[:288] + tokens(30, 23))  # vLLM's own cache now holds A's first 288 tokens' window
    eng.worker.worker_side.wait_idle(10)
    hits = sched_stats(eng).hit_tokens
    eng.add_request("B", a[:HIT] + tokens(40, 24))
    so, rep = eng.step_until_scheduled()
    local = HIT - (sched_stats(eng).hit_tokens - hits)
    assert so.scheduled_new_reqs[0].num_computed_tokens == HIT and 0 < local < HIT
    assert rep.corrupt_pages == 0 and rep.verified_pages == HIT // BLOCK + 3 * 7
    assert eng.run().corrupt_pages == 0


def test_a_hit_vllm_would_read_more_of_is_refused_not_loaded_wrong(serve, make_engine, sliding_model, monkeypatch):
    """A vLLM that kept two more blocks below the window than the rule hybridkv was built on (what its
    extra_retained_tokens does under multi-token speculation) would take them for KV the connector loaded: the
    load is refused, vLLM recomputes the request, and nothing wrong is read."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    srv = serve()
    eng = make_engine(srv.endpoint, model=sliding_model, num_blocks=512)
    a = tokens(900, 25)
    run(eng, "A", a)
    settle(eng)
    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens",
                        lambda self, n: max(0, n - self.sliding_window + 1 - 2 * BLOCK))
    eng.add_request("B", a[:HIT] + tokens(40, 26))
    assert eng.run().corrupt_pages == 0
    assert worker_stats(eng).load_failures == 1 and worker_stats(eng).loads == 0


@pytest.mark.parametrize("chunk", [16, 48, 64, 128, 160])
@pytest.mark.parametrize("window", [2, 17, 40, 100, 128, 300])
def test_load_block_ids_against_vllm_s_rule(chunk, window):
    """The blocks a load writes, for every hit, local prefix and window: exactly those vLLM holds past its local
    hit, never one it freed; a table that holds one more block than the rule is refused."""
    from hybridkv.model.layout import GroupLayout, ModelLayout

    layout = ModelLayout(model="m", groups=(
        GroupLayout(kind="sliding", layer_names=("model.layers.0",), page_bytes=64, block_tokens=BLOCK, window=window),
        GroupLayout(kind="attention", layer_names=("model.layers.1",), page_bytes=64, block_tokens=BLOCK)))
    for n in range(1, 9):
        hit = n * chunk
        for local in range(0, hit, BLOCK * 3):
            skipped = max(0, hit - window + 1) // BLOCK
            table = [HOLE if j < skipped else 100 + j for j in range(hit // BLOCK)]
            job = LoadJob("r", list(range(hit)), local, (table, list(range(hit // BLOCK))))
            sliding, attention = load_block_ids(layout, chunk, job)
            assert [j for j, b in enumerate(sliding) if b != HOLE] == [j for j in range(local // BLOCK, hit // BLOCK)
                                                                       if j >= skipped]
            assert [j for j, b in enumerate(attention) if b != HOLE] == list(range(local // BLOCK, hit // BLOCK))
            if skipped > local // BLOCK:  # vLLM holding one more block than its rule says
                more = list(table)
                more[skipped - 1] = 99
                job = LoadJob("r", list(range(hit)), local, (more, job.block_ids[1]))
                g, bpc, j = layout.groups[0], chunk // BLOCK, skipped - 1
                if j // bpc >= g.window_start_chunk(n, chunk) and j >= (j // bpc + 1) * bpc - g.tail_blocks(chunk):
                    assert load_block_ids(layout, chunk, job)[0][j] == 99  # a stored tail has it: it is loaded
                else:
                    with pytest.raises(LoadRefused, match="does not store"):
                        load_block_ids(layout, chunk, job)
