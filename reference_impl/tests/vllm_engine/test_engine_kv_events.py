"""A real engine started with `--kv-events-config` (vLLM's ZMQ publisher) and the connector: a subscriber, as a
KV-aware router runs one, receives hybridkv's BlockStored events (medium CPU) for the chunks the connector stored,
under the block hashes vLLM's own prefix cache publishes for the same blocks (medium GPU)."""

from __future__ import annotations

from enginekit import BLOCK, close_llm, engine_args, generate, prompt
from hybridkv_bench.kv_events import KVEventSubscriber, of_medium


def _flush(worker) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().worker_side.wait_idle(30)
    return 0


def test_the_engine_publishes_what_hybridkv_holds(model_dir, serve, sock_dir):
    from vllm import LLM
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored

    srv = serve(name="events")
    endpoint = f"ipc://{sock_dir}/events.sock"
    args = engine_args(model_dir, srv.endpoint)
    args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                                              topic="kv")
    llm = LLM(**args)
    sub = KVEventSubscriber(endpoint, "kv")
    try:
        p = prompt(700, seed=500)
        generate(llm, [p])
        n = (len(p) - 1) // BLOCK  # the chunks the connector stores (a state at every block boundary)
        llm.collective_rpc(_flush)  # every commit answered; the next step's output carries the last reports

        def stored(ev):
            return of_medium(ev, "CPU", BlockStored)

        def attention(ev):
            return [e for e in ev if e.kv_cache_spec_kind == "full_attention"]

        sub.wait_for(lambda ev: sum(len(e.block_hashes) for e in attention(stored(ev))) >= n,
                     step=lambda: generate(llm, [prompt(20, seed=501)], max_tokens=1), timeout_s=120)
        # the only prompt with a full block is p (the stepping prompts are shorter than a block)
        mine = attention(stored(sub.events))
        gpu = attention(of_medium(sub.events, "GPU", BlockStored))
        theirs = [h for e in gpu for h in e.block_hashes]
        assert len(theirs) == len(p) // BLOCK
        assert [h for e in mine for h in e.block_hashes] == theirs[:n]
        assert [t for e in mine for t in e.token_ids] == p[:n * BLOCK]
        assert {(e.block_size, e.group_idx) for e in mine} == {(BLOCK, gpu[0].group_idx)}
    finally:
        sub.close()
        close_llm(llm)
