"""The transformers adapter's read of a hit's pages into a fresh cache (`PageCodec.read_cache`), timed on the CPU
with the public API only (every tree runs it): a small hybrid model with wider K/V heads than the tiny preset (so
the bytes, not Python, dominate), `tokens` cached tokens, blocks in one run and scattered. One JSON line per case.

    PYTHONPATH=TREE/reference_impl:TREE/kernels:TREE/harness python read_cache.py [--tokens 8192] [--rounds 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch
from hybridkv.model.presets.gated_deltanet import TINY_HYBRID
from hybridkv_bench.engines.hf.model import build_model
from hybridkv_bench.engines.hf.pages import PageCodec
from hybridkv_bench.engines.hf.spec import TransformersSpec
from hybridkv_bench.engines.pools import EnginePools


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = dataclasses.replace(TINY_HYBRID, kv_dtype="float32", conv_dtype="float32", num_kv_heads=4, head_dim=64)
    layout = cfg.layout()
    chunk = layout.default_chunk_tokens()
    n_chunks = args.tokens // chunk
    hf = build_model(TransformersSpec(arch="qwen3_5"), cfg, torch.device("cpu"))
    pools = EnginePools(layout, 2 * sum(EnginePools.blocks_for(layout, n_chunks * chunk)) + 8, torch.device("cpu"))
    for group in pools.pages:
        for t in group:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    codec = PageCodec(hf, layout, pools.pages, chunk)
    need = EnginePools.blocks_for(layout, n_chunks * chunk)
    rng = np.random.default_rng(0)
    for order in ("one run", "scattered"):
        blocks = []
        for n in need:
            ids = list(range(n)) if order == "one run" else rng.permutation(pools.num_blocks)[:n].tolist()
            blocks.append(ids)
        spans = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            codec.read_cache(blocks, n_chunks)
            spans.append(time.perf_counter() - t0)
        print(json.dumps({"blocks": order, "tokens": n_chunks * chunk,
                          "read_cache_p50_ms": statistics.median(spans) * 1e3}), flush=True)


if __name__ == "__main__":
    main()
