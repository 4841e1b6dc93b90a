"""KV cache events through vLLM's own publisher (`--kv-events-config`, ZMQ) to a subscriber as a KV-aware router
runs one: what hybridkv holds is published as BlockStored (medium CPU) with vLLM's own block hashes (the ones its
GPU prefix cache publishes for the same blocks), what a lookup finds evicted as BlockRemoved, vLLM's reset of the
external cache as AllBlocksCleared; a store is announced only once every tensor-parallel rank committed it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P
from hybridkv_bench.kv_events import KVEventSubscriber, of_medium
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllmkit import C, run, settle, tokens


def kv_events_config(sock_dir: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock_dir}/events.sock",
            "topic": "kv"}


@pytest.fixture
def subscribe(sock_dir):
    subs: list[KVEventSubscriber] = []

    def sub() -> KVEventSubscriber:
        s = KVEventSubscriber(f"ipc://{sock_dir}/events.sock", "kv")
        subs.append(s)
        return s

    yield sub
    for s in subs:
        s.close()


def hashes(events, group: int) -> list[int]:
    return [h for e in events if e.group_idx == group for h in e.block_hashes]


def test_stores_evictions_and_the_reset_reach_a_router(serve, make_engine, subscribe, sock_dir):
    srv = serve("--admin")
    eng = make_engine(srv.endpoint, kv_events=kv_events_config(sock_dir))
    sub = subscribe()
    lay = eng.layout
    att, gdn = lay.attention_groups[0], lay.recurrent_groups
    a = tokens(4 * C + 9, 60)
    run(eng, "A", a)
    eng.worker.worker_side.wait_idle(10)  # the last commit's answer rides the next step's output
    sub.wait_for(lambda ev: len(hashes(of_medium(ev, "CPU", BlockStored), att)) >= 4, step=eng.step)

    stored = of_medium(sub.events, "CPU", BlockStored)
    gpu = hashes(of_medium(sub.events, "GPU", BlockStored), att)  # vLLM's own prefix cache's events
    assert len(gpu) == 4 and len(stored) == 4 * len(lay.groups)  # one store per chunk, one event per group
    # attention: every block of the 4 stored chunks under vLLM's own hash of it, chained, with its tokens
    on_att = [e for e in stored if e.group_idx == att]
    assert hashes(on_att, att) == gpu
    assert [e.parent_block_hash for e in on_att] == [None, *gpu[:3]]
    assert [t for e in on_att for t in e.token_ids] == a[:4 * C]
    assert {(e.block_size, e.kv_cache_spec_kind, e.lora_name) for e in on_att} == {(C, "full_attention", None)}
    # each GDN group: the block whose state each store holds (one block = one chunk here: all of them)
    for g in gdn:
        assert hashes(stored, g) == gpu
        assert {e.kv_cache_spec_kind for e in stored if e.group_idx == g} == {"mamba"}
    assert not of_medium(sub.events, "CPU", BlockRemoved)

    # the server drops everything (an eviction the connector is not told of): the next lookup of the prefix
    # finds nothing, and every announced block is withdrawn
    with CacheClient(srv.endpoint, timeout_s=10) as c:
        c.call(P.Clear())
    settle(eng)  # vLLM's own prefix cache forgets A too, so B asks hybridkv
    run(eng, "B", a[:4 * C] + tokens(30, 61))
    removed = sub.wait_for(lambda ev: len(hashes(of_medium(ev, "CPU", BlockRemoved), att)) >= 4, step=eng.step)
    removed = of_medium(removed, "CPU", BlockRemoved)
    for g in range(len(lay.groups)):
        assert sorted(hashes(removed, g)) == sorted(gpu)

    # vLLM's reset of the external cache (POST /reset_prefix_cache?reset_external=true): AllBlocksCleared
    eng.worker.worker_side.wait_idle(10)
    seen = len(sub.events)
    assert eng.scheduler.reset_connector_cache()
    after = sub.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev[seen:]), step=eng.step)[seen:]
    assert [type(e) for e in after if isinstance(e, AllBlocksCleared)] == [AllBlocksCleared]


def test_a_store_is_announced_once_every_rank_holds_it(serve, make_engine, subscribe, sock_dir):
    srv = serve()
    eng = make_engine(srv.endpoint, kv_events=kv_events_config(sock_dir))
    sub = subscribe()
    eng.scheduler.connector.scheduler_side.events.tp_size = 2  # as if a second rank stored its own shard
    ws = eng.worker.worker_side
    take = ws.take_store_reports
    second_rank_ok = {"A": False, "B": True}  # rank 1 failed A's stores and committed B's
    ws.take_store_reports = lambda: [x for r in take() for x in (r, (1, *r[1:4], r[4] and second_rank_ok[r[1]]))]
    a, b = tokens(2 * C + 5, 62), tokens(2 * C + 5, 63)
    run(eng, "A", a)
    ws.wait_idle(10)
    run(eng, "B", b)
    ws.wait_idle(10)
    att = eng.layout.attention_groups[0]
    sub.wait_for(lambda ev: len(hashes(of_medium(ev, "CPU", BlockStored), att)) >= 2, step=eng.step)
    eng.step()
    sub.poll(0.2)
    on_att = [e for e in of_medium(sub.events, "CPU", BlockStored) if e.group_idx == att]
    assert [t for e in on_att for t in e.token_ids] == b[:2 * C]  # B's stores only: A's failed on rank 1
