"""What a load builds on its critical path before its first copy is queued, timed on the CPU with the public API
only (so that every tree runs it): the plan of a Qwen3.6-27B TP8 load's objects over the arena's slots
(`plan_pages` + `bind`) and its DMA runs (`dma_runs`). One JSON line per chunk count: p50 microseconds.

    PYTHONPATH=TREE/reference_impl:TREE/kernels:TREE/harness python plan_build.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np
from hybridkv.engine.config import TransferConfig
from hybridkv.engine.transfer import KVTransfer
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.microbench.fixed_cost import small_pages
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools
from hybridkv_kernels import plan_pages
from hybridkv_kernels.copy_dma import dma_runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 17, 71])
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="hkv-")
    srv = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=GIB // 4))
    try:
        for chunks in args.chunks:
            layout = small_pages(preset_layout("qwen3.6-27b", 8), 64)
            per = chunks + 1
            nb = per * len(layout.groups) * 2
            pools = vllm_pools(layout, nb, "cpu")
            fill_random(pools, 0)
            alloc = BlockAllocator(nb)
            src = [alloc.allocate(per) for _ in layout.groups]
            dst = [alloc.allocate(per) for _ in layout.groups]
            with KVTransfer(srv.endpoint, layout, pools, TransferConfig(salt=f"plan-{chunks}")) as kv:
                tok = np.random.default_rng(chunks).integers(0, 150_000, chunks * kv.chunk_tokens + 1)
                kv.store("s", tok, src).wait_committed(30)
                kv.end_session("s")
                hit = kv.lookup("l", tok)
                items = kv.wire.slots(kv._object_blocks(hit.objects, dst))
                transfers = [(kv.groups[o.group], ids) for o, ids, _ in items]
                objects = [host for _, _, host in items]
                spans = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    dma_runs(plan_pages("scatter", transfers).bind(objects))
                    spans.append(time.perf_counter() - t0)
                print(json.dumps({"chunks": chunks, "objects": len(objects),
                                  "plan_build_and_runs_p50_us": statistics.median(spans) * 1e6}), flush=True)
    finally:
        srv.close()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
