"""The negative control of tests/engine/test_transfer_order.py::test_a_store_ordered_on_the_engine_stream_is_read_
before_later_writes: the same store and overwrite, with and without making the engine's stream wait for the
store's copies (order_after_copies). Prints the stored pages that hold the later writes, per layout and mode."""

import tempfile

import numpy as np
import torch
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.presets import preset_layout
from hybridkv.server.config import ServerConfig
from hybridkv.server.launch import start_server
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

GIB = 1 << 30
d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
srv = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=2 * GIB))
try:
    for preset, tp in (("tiny-hybrid", 1), ("qwen3.6-27b", 8)):
        for ordered in (False, True):
            layout = preset_layout(preset, tp)
            pools = vllm_pools(layout, 48, "cuda")
            fill_random(pools, 8)
            alloc = BlockAllocator(48)
            cfg = TransferConfig(copy_engine="dma", salt=f"{preset}-{ordered}")
            with KVTransfer(srv.endpoint, layout, pools, cfg) as kv:
                chunks, ct = 2, kv.chunk_tokens
                bpc = [ct // g.block_tokens for g in layout.groups]
                tokens = np.random.default_rng(9).integers(0, 150_000, chunks * ct)
                src = [alloc.allocate(chunks * b) for b in bpc]
                want = [[t[ids].clone() for t in pools[g]] for g, ids in enumerate(src)]
                prep = kv.prepare_store("s", tokens, block_ids=src)
                prep.wait(30)
                torch.cuda.synchronize()
                torch.cuda._sleep(200_000_000)
                h = kv.store("s", tokens, src, prepared=prep)
                if ordered:
                    assert h.order_after_copies(torch.cuda.current_stream())
                for g, ids in enumerate(src):
                    for t in pools[g]:
                        t[ids] = 0
                h.wait_committed(30)
                kv.end_session("s")
                dst = [alloc.allocate(chunks * b) for b in bpc]
                hit = kv.lookup("c", tokens)
                kv.retrieve(hit, dst).wait(30)
                torch.cuda.synchronize()
                wrong = total = 0
                for g, grp in enumerate(layout.groups):
                    rows = range(len(src[g])) if grp.kind == "attention" else [chunks * bpc[g] - 1]
                    for t, w in zip(pools[g], want[g], strict=True):
                        for r in rows:
                            total += 1
                            wrong += not torch.equal(t[dst[g][r]], w[r])
                print(f"{preset} tp{tp} ordered={ordered}: {wrong} of {total} stored pages hold the later writes")
finally:
    srv.close()
