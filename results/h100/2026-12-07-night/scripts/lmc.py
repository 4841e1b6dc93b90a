# ruff: noqa: B007, B023, E402, E741 - the session script as it ran (formatted only): closures run inside their loop
"""Session probe (issue 37 item 5): LMCache 0.5.6's CUDA ops loaded from its wheel (lmcache/__init__ skipped: it
pulls the whole package's dependencies), and if they load, its paged-KV GPU<->CPU transfer beside ours on the same
pages and the same pinned host bytes. python3 lmc.py UNZIPPED_WHEEL_DIR"""

import importlib
import json
import statistics
import sys
import traceback
import types

import numpy as np
import torch

root = sys.argv[1]
pkg = types.ModuleType("lmcache")
pkg.__path__ = [f"{root}/lmcache"]
sys.modules["lmcache"] = pkg
out = {"torch": torch.__version__, "cuda": torch.version.cuda}
mods = {}
for m in ("lmcache.lmcache_native", "lmcache.cuda_ops"):
    try:
        mods[m] = importlib.import_module(m)
        out[m] = "loaded"
    except BaseException as e:
        out[m] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
sys.stdout.flush()
ops = mods.get("lmcache.cuda_ops")
if ops is None:
    sys.exit(0)
print("cuda_ops names:", [n for n in dir(ops) if not n.startswith("_")])
for n in (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "lmcache_memcpy_async",
    "multi_layer_block_kv_transfer",
):
    f = getattr(ops, n, None)
    print(f"--- {n}:", (f.__doc__ or "").strip()[:900] if f else "absent")
sys.stdout.flush()
nat = mods.get("lmcache.lmcache_native")
TD = getattr(nat, "TransferDirection", None) or getattr(ops, "TransferDirection", None)
FMT = getattr(nat, "EngineKVFormat", None) or getattr(ops, "EngineKVFormat", None)
print("enums:", TD, FMT)
from hybridkv_kernels import PagedLayers, build_plan, run_plan
from hybridkv_kernels.copy_dma import dma_runs

# Qwen3.6-27B on one TP8 rank: an attention layer's page is K then V of 400 tokens x 1 head x 256 (bf16, 409,600 B)
L, NB, BS, NH, HS = 16, 96, 400, 1, 256
dev = torch.device("cuda")
kv = [torch.randn(NB, 2, BS, NH, HS, dtype=torch.bfloat16, device=dev) for _ in range(L)]
rows = []
for chunks in (2, 8, 32):
    blocks = np.random.default_rng(chunks).permutation(NB)[:chunks].astype(np.int64)
    T = chunks * BS
    nbytes = L * chunks * 2 * BS * NH * HS * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # the same pinned bytes for both
    timings = {}

    def med(fn, n=30):
        s = torch.cuda.Stream()
        ts = []
        for i in range(n + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record(s)
                fn(s)
                b.record(s)
            b.synchronize()
            if i >= 3:
                ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)

    group = PagedLayers.from_tensors(kv, 2 * BS * NH * HS * 2)
    for d in ("gather", "scatter"):
        plan = build_plan(d, [(group, blocks, host)])
        runs = dma_runs(plan)
        timings[f"ours_dma_{d}"] = med(lambda s: run_plan(plan, "dma", s, runs))
        try:
            timings[f"ours_triton_{d}"] = med(lambda s: run_plan(plan, "triton", s))
        except Exception as e:
            timings[f"ours_triton_{d}"] = repr(e)[:200]
    try:
        ptrs = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64, device=dev)
        slots = torch.as_tensor((blocks[:, None] * BS + np.arange(BS)[None]).reshape(-1), device=dev)
        obj = host.view(torch.bfloat16).view(2, L, T, NH * HS)  # LMCache's KV_2LTD object, in the same pinned bytes
        fmt = FMT.NL_X_NB_TWO_BS_NH_HS if FMT is not None else 2
        for name, direction in (("gather", "D2H"), ("scatter", "H2D")):
            dirv = getattr(TD, direction) if TD is not None else (1 if direction == "D2H" else 0)
            call = lambda s: ops.multi_layer_kv_transfer(
                obj, ptrs, slots, dev, NB * BS, dirv, fmt, block_size=BS, head_size=HS, block_stride_elems=0
            )
            timings[f"lmcache_kernel_{name}"] = med(call)
        # correctness: LMCache's gather against the pages
        host.zero_()
        ops.multi_layer_kv_transfer(
            obj,
            ptrs,
            slots,
            dev,
            NB * BS,
            getattr(TD, "D2H", 1),
            fmt,
            block_size=BS,
            head_size=HS,
            block_stride_elems=0,
        )
        torch.cuda.synchronize()
        ref = (
            torch.stack(
                [
                    torch.stack([kv[l][int(b), k].reshape(BS, NH * HS) for b in blocks]).reshape(T, NH * HS)
                    for k in range(2)
                    for l in range(L)
                ]
            )
            .reshape(2, L, T, NH * HS)
            .cpu()
        )
        timings["lmcache_gather_equal"] = bool(torch.equal(ref, obj))
        # its staging path: the kernel into a GPU buffer, then one DMA copy to the pinned bytes
        stage = torch.empty(2, L, T, NH * HS, dtype=torch.bfloat16, device=dev)

        def staged(s):
            ops.multi_layer_kv_transfer(
                stage,
                ptrs,
                slots,
                dev,
                NB * BS,
                getattr(TD, "D2H", 1),
                fmt,
                block_size=BS,
                head_size=HS,
                block_stride_elems=0,
            )
            obj.copy_(stage, non_blocking=True)

        timings["lmcache_staged_gather"] = med(staged)
    except Exception:
        timings["lmcache_error"] = traceback.format_exc()[-1500:]
    gb = {k: (round(nbytes / v / 1e9, 2) if isinstance(v, float) else v) for k, v in timings.items()}
    print(json.dumps({"chunks": chunks, "bytes": nbytes, "GBps": gb}))
    sys.stdout.flush()
# the pinned-copy ceiling, for the ratios
big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
hb = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
for n, f in (("d2h", lambda: hb.copy_(big, non_blocking=True)), ("h2d", lambda: big.copy_(hb, non_blocking=True))):
    f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    [f() for _ in range(3)]
    b.record()
    b.synchronize()
    print(json.dumps({"ceiling": n, "GBps": round(3 * (1 << 30) / (a.elapsed_time(b) / 1e3) / 1e9, 2)}))
