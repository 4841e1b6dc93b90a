# ruff: noqa: B007, B023, E402, E741 - the session script as it ran (formatted only): closures run inside their loop
"""Session probe (issue 37 item 1): a multi-chunk load alone, with a prepare_store answered beside it (as the
sim engine issues one right after the lookup), and with a store in flight beside it; p50 us. Runs over any tree's
library through the public KVTransfer API: python3 beside.py TAG --chunks 8 --rounds 40"""

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

try:
    from hybridkv.server.books.config import ServerConfig
    from hybridkv.server.front.launch import start_server
except ImportError:
    from hybridkv.server.config import ServerConfig
    from hybridkv.server.launch import start_server
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.presets import preset_layout
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

ap = argparse.ArgumentParser()
ap.add_argument("tag")
ap.add_argument("--chunks", type=int, nargs="+", default=[3, 8, 15])
ap.add_argument("--rounds", type=int, default=40)
ap.add_argument("--device", default="cuda")
ap.add_argument("--preset", default="qwen3.6-27b:8")
a = ap.parse_args()
name, tp = a.preset.split(":")
layout = preset_layout(name, int(tp))
d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
server = start_server(
    ServerConfig(
        endpoint=f"ipc://{d}/s.sock", l1_bytes=int(float(__import__("os").environ.get("L1_GIB", "12")) * (1 << 30))
    )
)
G = len(layout.groups)
maxc = max(a.chunks) + 3
nb = maxc * G * 3 + 8
pools = vllm_pools(layout, nb, a.device)
fill_random(pools, 0)
alloc = BlockAllocator(nb)
src = [alloc.allocate(maxc) for _ in range(G)]
dst = [alloc.allocate(maxc) for _ in range(G)]
oth = [alloc.allocate(maxc) for _ in range(G)]
rng = np.random.default_rng(0)
fresh = iter(range(1 << 30))
p50 = lambda xs: round(statistics.median(xs) * 1e6)
with KVTransfer(server.endpoint, layout, pools, TransferConfig(salt=f"beside-{a.tag}")) as kv:
    ct = kv.chunk_tokens

    def toks(n):
        t = rng.integers(0, 150_000, n * ct + 1)
        t[0] = next(fresh)
        return t

    for n in a.chunks:
        stored = toks(n)
        kv.store("L0", stored, src).wait_committed(30)
        kv.end_session("L0")
        for mode in ("alone", "prepare", "store", "alone"):
            loads, rets, issues, waits, sprep = [], [], [], [], []
            for r in range(a.rounds):
                rid = f"r{next(fresh)}"
                req = np.concatenate([stored[: n * ct], toks(2)])  # the next turn: the history + 2 new chunks
                other = None
                if mode == "store":  # another request's store, its prepare answered, issued just before
                    orid = f"o{next(fresh)}"
                    ot = toks(2)
                    op = kv.prepare_store(orid, ot, block_ids=oth)
                    op.wait(30)
                torch.cuda.synchronize() if a.device == "cuda" else None
                t0 = time.perf_counter()
                hit = kv.lookup(rid, req)
                prep = kv.prepare_store(rid, req, block_ids=dst) if mode == "prepare" else None
                if mode == "store":
                    other = kv.store(orid, ot, oth, prepared=op)
                t1 = time.perf_counter()
                h = kv.retrieve(hit, dst).wait(30)
                t2 = time.perf_counter()
                assert hit.hit_chunks == n, (hit.hit_chunks, n)
                loads.append(t2 - t0)
                rets.append(t2 - t1)
                issues.append(h.t_copy_issued - h.t_copy_start)
                waits.append(t2 - h.t_copy_issued)
                if prep is not None:
                    s = kv.store(rid, req, dst, prepared=prep).wait_committed(30)
                    sprep.append(s.t_copy_issued - s.t_copy_start)
                if other is not None:
                    other.wait_committed(30)
                    kv.end_session(orid)
                kv.end_session(rid)
            row = {
                "tag": a.tag,
                "chunks": n,
                "mode": mode,
                "load_us": p50(loads),
                "retrieve_us": p50(rets),
                "issue_us": p50(issues),
                "after_issue_us": p50(waits),
                "store_issue_us": p50(sprep) if sprep else None,
                "bytes": h.nbytes,
            }
            print(json.dumps(row))
            sys.stdout.flush()
server.close()
