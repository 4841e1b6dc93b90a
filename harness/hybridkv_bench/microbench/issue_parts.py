"""What queueing one prepared store's page copies costs on the caller's thread, part by part (issue 26).

`PageCopies.issue` of a prepared store binds the planned pages to the reserved slots, then queues the runs
of pages on the copy engines. This times, p50 over `rounds` on a real server and the presets' own pages:
the whole `issue`, and each of its parts alone (the slots, the bind, the runs, the batched driver calls, the
stream joins and events), then a cProfile of `issue`. On a CPU the copies run inside `issue` (memcpy), so
only the CUDA figures say what queueing costs.

    python -m hybridkv_bench.microbench.issue_parts --device cuda [--presets qwen3.6-27b:8] [--chunks 2 71]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from hybridkv.engine.config import TransferConfig
from hybridkv.engine.handles import TransferHandle
from hybridkv.engine.transfer import KVTransfer
from hybridkv.engine.wire import DirectWire
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_kernels import copy_dma, cuda_batch
from hybridkv_kernels.copy_dma import copy_runs

from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools


def _p50_us(fn: Callable[[], object], rounds: int, after: Callable[[], object] | None = None) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t0)
        if after is not None:
            after()
        del r
    return statistics.median(out) * 1e6


def parts(endpoint: str, name: str, tp: int, chunks: int, rounds: int, device: str, top: int) -> dict:
    """p50 microseconds of a prepared store's `issue` and of its parts; the cProfile text under 'profile'."""
    layout = preset_layout(name, tp)
    blocks = chunks + 1
    num_blocks = blocks * len(layout.groups) * 2
    pools = vllm_pools(layout, num_blocks, device)
    fill_random(pools, 0)
    src = [BlockAllocator(num_blocks).allocate(blocks) for _ in layout.groups]
    tokens = np.random.default_rng(chunks).integers(0, 150_000, chunks * layout.default_chunk_tokens() + 1)
    out: dict = {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with KVTransfer(endpoint, layout, pools, TransferConfig(salt=f"issue-{name}-{tp}-{chunks}")) as kv:
        prep = kv.prepare_store("i", tokens, block_ids=src)
        reply = prep.wait(30)
        assert isinstance(kv.wire, DirectWire) and prep.pages is not None and prep.jobs is not None
        jobs = kv.route._slot_jobs(reply, prep.jobs)
        items = kv.wire.slots(jobs)
        pages = prep.pages
        copies = kv.copies

        def issue() -> object:
            return copies.issue(TransferHandle("store", "i"), "gather", items, None, pages)

        for _ in range(5):
            issue()
            sync()
        out["issue"] = _p50_us(issue, rounds, sync)
        out["issue_to_copied"] = _p50_us(lambda: (issue(), sync()), rounds)
        if device == "cuda" and hasattr(copy_dma, "SPLIT_MIN_RUNS"):  # one stream, one driver call per plan
            split, copy_dma.SPLIT_MIN_RUNS = copy_dma.SPLIT_MIN_RUNS, 1 << 30
            try:
                out["issue_one_stream"] = _p50_us(issue, rounds, sync)
                out["issue_to_copied_one_stream"] = _p50_us(lambda: (issue(), sync()), rounds)
            finally:
                copy_dma.SPLIT_MIN_RUNS = split
        if hasattr(copies, "bind"):  # plans bound when the prepare is answered: what the store queues then
            out["bind_ahead"] = _p50_us(lambda: copies.bind("gather", items, pages), rounds)
            bound = copies.bind("gather", items, pages)
            out["issue_prebound"] = _p50_us(
                lambda: copies.issue(TransferHandle("store", "i"), "gather", [], None, bound=bound), rounds, sync)
        wire = kv.wire
        assert isinstance(wire, DirectWire), "issue_parts times the shm wire (the one that queues copies itself)"
        out["slots"] = _p50_us(lambda: wire.slots(kv.route._slot_jobs(reply, prep.jobs or [])), rounds)
        hosts = {(o.chunk, o.group): host for o, _, host in items}
        half, order = next(iter(pages.values()))
        out["bind"] = _p50_us(lambda: half.bind([hosts.get(k) for k in order]), rounds)
        plan = half.bind([hosts.get(k) for k in order])
        out["copy_runs"] = _p50_us(lambda: copy_runs(plan), rounds)
        starts, lengths = copy_runs(plan)
        out["pages"], out["runs"], out["objects"] = plan.num_pages, len(starts), len(items)
        batch = cuda_batch.get() if device == "cuda" else None
        if batch is not None:
            s = copies.streams["store"][0]
            assert s is not None
            dst, srca, sizes = plan.dst_addr[starts], plan.src_addr[starts], lengths * plan.page_bytes
            dev = torch.cuda.current_device()
            out["batch_all_runs_one_call"] = _p50_us(lambda: batch(dst, srca, sizes, s.cuda_stream, dev), rounds, sync)
            one = (dst[:1], srca[:1], sizes[:1])
            out["batch_one_run"] = _p50_us(lambda: batch(*one, s.cuda_stream, dev), rounds, sync)
            side = torch.cuda.Stream()

            def join() -> None:
                side.wait_stream(s)
                s.wait_stream(side)

            out["wait_stream_pair"] = _p50_us(join, rounds, sync)

            def event() -> torch.cuda.Event:
                ev = torch.cuda.Event()
                ev.record(s)
                return ev

            out["event_new_record"] = _p50_us(event, rounds, sync)
            ev = event()
            out["wait_event"] = _p50_us(lambda: s.wait_event(ev), rounds, sync)
            out["event_record_reused"] = _p50_us(lambda: ev.record(s), rounds, sync)
            out["current_stream"] = _p50_us(lambda: torch.cuda.current_stream(), rounds)
            slot = items[0][2]
            base = slot._base if slot._base is not None else slot
            out["is_pinned"] = _p50_us(lambda: base.is_pinned(), rounds)
            out["ctx_get_current"] = _p50_us(lambda: batch._ensure_context(dev), rounds)
            if reply.fence:  # the fence step of a fenced store (no commit is pending: the server ignores the word)
                word = kv.wire.fence_word(reply.fence)
                out["fence"] = _p50_us(lambda: copies.fence([], word, reply.reservation), rounds, sync)
        prof = cProfile.Profile()
        for _ in range(rounds):
            prof.enable()
            issue()
            prof.disable()
            sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        out["profile"] = text.getvalue()
        kv.end_session("i")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m hybridkv_bench.microbench.issue_parts",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 71])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--presets", nargs="+", default=["qwen3.6-27b:8"], metavar="NAME:TP")
    ap.add_argument("--l1-gib", type=float, default=4)
    ap.add_argument("--top", type=int, default=25, help="cProfile lines")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dma-batch", choices=["on", "off"], default="on",
                    help="off: CUDA page copies one driver call per run, not batched (for comparisons)")
    args = ap.parse_args(argv)
    cuda_batch.set_enabled(args.dma_batch == "on")
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    server = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=int(args.l1_gib * GIB)))
    try:
        for p in args.presets:
            name, tp = p.rsplit(":", 1)
            for chunks in args.chunks:
                row = parts(server.endpoint, name, int(tp), chunks, args.rounds, args.device, args.top)
                prof = row.pop("profile")
                head = {"preset": name, "tp": int(tp), "chunks": chunks, "device": args.device}
                if args.json:
                    print(json.dumps({**head, "p50_us": row}))
                else:
                    print(f"{name} TP{tp} {chunks} chunks (p50 us): " +
                          "  ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
                print(prof)
    finally:
        server.close()
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
