"""The fixed cost of a store and of a load, step by step, against a real server.

Layouts keep a preset's groups, layers and block size but pages of `page_bytes` (64 B by default), so
the copy is negligible and what is left is what every store and load pays whatever its size: hashing
the keys, the round trips, the per-object block lists, the copy plan, the hand-offs between threads.
Each step is timed on its own (p50 over `rounds`), then the whole call as an engine issues it:

- `store`: `store()` submitted -> committed, no prepare issued before (every step on the critical path);
- `store_prepared`: `store(prepared=...)` submitted -> committed, the prepare issued earlier and answered
  (what is left on the critical path when the engine prepares at schedule time);
- `load`: `lookup` + `retrieve()` submitted -> pages written;
- `load_beside_prepare`: `retrieve()` -> pages written, the request's store prepared right after the lookup (as an
  engine prepares at schedule time), beside `load_retrieve`, the same span without it.

A whole store and a whole load are split into steps by their handle's timestamps (`STORE_STEPS`,
`LOAD_STEPS` below): hand-offs between threads, binding the plan and queueing the copies, waiting for
them, the commit round trip, and waking the caller.

    python -m hybridkv_bench.microbench.fixed_cost [--rounds 200] [--chunks 2 71] [--presets qwen3.6-27b:8] [--json]
    python -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 24   # on a GPU, real pages
With `--page-bytes 0` the presets' own pages are kept: the copy is then real, and the split of a whole store
shows what is fixed around it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Literal

import msgspec
import numpy as np
import torch
from hybridkv.engine.client import CacheClient
from hybridkv.engine.config import COMMIT_MODES, CommitMode, TransferConfig
from hybridkv.engine.transfer import KVTransfer, TransferHandle
from hybridkv.engine.wire import DirectWire
from hybridkv.model.layout import ModelLayout
from hybridkv.model.policy import chunk_objects
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from hybridkv_kernels import build_plan, copy_dma, cuda_batch, run_plan

from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

_ROWS = itertools.count()
PRESETS = (("qwen3.6-27b", 1), ("qwen3.6-27b", 8), ("qwen3-next-80b-a3b", 1))


def small_pages(layout: ModelLayout, page_bytes: int) -> ModelLayout:
    """`layout` with every group's pages shrunk to `page_bytes` (groups, layers, block tokens kept)."""
    return msgspec.structs.replace(layout, groups=tuple(msgspec.structs.replace(g, page_bytes=page_bytes)
                                                        for g in layout.groups))


def _p50_us(fn: Callable[[], object], rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


# A store: submit -> the copier starts (the hand-off to the store worker, the prepare's answer, the slots'
# block lists); the plan bound and every copy queued; the wait for the copies; -> the commit sent; the
# commit round trip (answered on the client's I/O thread); -> the caller woken. A load: the lookup's return
# -> the copier starts (hand-off to the load worker), the plan built and queued, the wait, -> caller woken.
STORE_STEPS = ("to_copy", "issue", "wait", "to_send", "commit_rt", "wake")
LOAD_STEPS = ("to_copy", "issue", "wait", "wake")


def _store_steps(h, t0: float, t1: float) -> tuple[float, ...]:
    return (h.t_copy_start - t0, h.t_copy_issued - h.t_copy_start, h.t_done - h.t_copy_issued,
            h.t_commit_sent - h.t_done, h.t_committed - h.t_commit_sent, t1 - h.t_committed)


def _step_costs(kv: KVTransfer, layout: ModelLayout, src: list[list[int]], tok: np.ndarray, rounds: int,
                device: str) -> tuple[dict[str, float], int]:
    """p50 microseconds of each step of a store on its own; and how many objects the store moves."""
    out: dict[str, float] = {}
    out["keys"] = _p50_us(lambda: kv.keys(tok), rounds)
    keys = kv.keys(tok)
    objects = chunk_objects(layout, kv.config.store_policy, 0, len(keys))

    def prepare_abort() -> P.Prepared:
        prep, _ = kv.client.call(P.PrepareStore(engine=kv.engine_id, request="p", keys=keys, objects=objects))
        return prep

    spans: list[float] = []
    for _ in range(rounds):  # the same objects each round: abort (untimed) before the next prepare
        t0 = time.perf_counter()
        prep = prepare_abort()
        spans.append(time.perf_counter() - t0)
        kv.client.call(P.AbortStore(engine=kv.engine_id, reservation=prep.reservation))
    out["prepare_rt"] = statistics.median(spans) * 1e6
    prep = prepare_abort()
    out["object_blocks"] = _p50_us(lambda: kv._object_blocks(prep.slots, src), rounds)
    jobs = kv._object_blocks(prep.slots, src)
    assert isinstance(kv.wire, DirectWire)  # the default format, shm
    triples = kv.wire.slots(jobs)
    transfers = [(kv.groups[o.group], ids, host) for o, ids, host in triples]
    out["build_plan"] = _p50_us(lambda: build_plan("gather", transfers), rounds)
    plan = build_plan("gather", transfers)

    def copy() -> None:
        run_plan(plan, kv.impl, None)
        if device == "cuda":
            torch.cuda.synchronize()

    out["run_plan"] = _p50_us(copy, rounds)
    commit = P.CommitStore(engine=kv.engine_id, reservation=prep.reservation)
    out["commit_rt"] = _p50_us(lambda: kv.client.call(commit), 1)  # a reservation commits once
    out["end_session_rt"] = _p50_us(lambda: kv.end_session("p"), rounds)
    return out, len(objects)


def _whole_stores(kv: KVTransfer, src: list[list[int]], tokens: Callable[[], np.ndarray], fresh, objects: int,
                  rounds: int) -> dict[str, float]:
    """p50 microseconds of a whole store, unprepared and prepared, and of each of its STORE_STEPS."""
    out: dict[str, float] = {}
    for name, prepared in (("store", False), ("store_prepared", True)):
        spans: list[float] = []
        steps: list[tuple[float, ...]] = []

        def run(prepared: bool = prepared, spans: list[float] = spans, steps: list[tuple[float, ...]] = steps) -> None:
            t = tokens()
            rid = f"s{next(fresh)}"
            prep = kv.prepare_store(rid, t, block_ids=src) if prepared else None
            if prep is not None:
                prep.wait(30)
            t0 = time.perf_counter()
            h = kv.store(rid, t, src, prepared=prep).wait_committed(30)
            t1 = time.perf_counter()
            spans.append(t1 - t0)
            steps.append(_store_steps(h, t0, t1))
            assert h.objects == objects, (h.objects, objects)
            kv.end_session(rid)

        _p50_us(run, rounds)
        out[name] = statistics.median(spans) * 1e6
        for i, part in enumerate(STORE_STEPS):
            out[f"{name}.{part}"] = statistics.median(s[i] for s in steps) * 1e6
    return out


def _loads(kv: KVTransfer, stored: np.ndarray, dst: list[list[int]], rounds: int,
           src: list[list[int]] | None = None, tail: Callable[[], np.ndarray] | None = None) -> dict[str, float]:
    """p50 microseconds of a lookup, a whole load and each of its LOAD_STEPS, for `stored` (already stored).
    With `src` and `tail`: also `load_beside_prepare`, the load's `retrieve()` -> pages written when the request's
    store (`stored` + `tail()`'s tokens, from blocks `src`) was prepared right after the lookup, as an engine
    prepares it at schedule time: its answer comes while the load's copies are being queued."""
    out: dict[str, float] = {}
    lookups: list[float] = []
    loads: list[float] = []
    load_steps: list[tuple[float, ...]] = []
    for _ in range(rounds):  # each timed alone; the session's end (untimed) drops the pins
        t0 = time.perf_counter()
        hit = kv.lookup("l", stored)
        t1 = time.perf_counter()
        h = kv.retrieve(hit, dst).wait(30)
        t2 = time.perf_counter()
        loads.append(t2 - t0)
        lookups.append(t1 - t0)
        load_steps.append((h.t_copy_start - t1, h.t_copy_issued - h.t_copy_start, h.t_done - h.t_copy_issued,
                           t2 - h.t_done))
        kv.end_session("l")
    out["lookup_rt"] = statistics.median(lookups) * 1e6
    out["load"] = statistics.median(loads) * 1e6
    for i, part in enumerate(LOAD_STEPS):
        out[f"load.{part}"] = statistics.median(s[i] for s in load_steps) * 1e6
    if src is None or tail is None:
        return out
    for name, beside in (("load_retrieve", False), ("load_beside_prepare", True)):
        spans, issues = [], []
        for _ in range(rounds):  # the prepared store aborted by the session's end (untimed)
            hit = kv.lookup("b", stored)
            if beside:
                kv.prepare_store("b", np.concatenate([stored, tail()]), block_ids=src)
            t1 = time.perf_counter()
            h = kv.retrieve(hit, dst).wait(30)
            spans.append(time.perf_counter() - t1)
            issues.append(h.t_copy_issued - h.t_copy_start)
            kv.end_session("b")
        out[name] = statistics.median(spans) * 1e6
        out[f"{name}.issue"] = statistics.median(issues) * 1e6
    return out


def profile(endpoint: str, layout: ModelLayout, chunks: int, rounds: int, device: str = "cpu",
            commit: CommitMode = "after_copies") -> dict[str, float]:
    """p50 microseconds of each step of a `chunks`-chunk store and load, and of the whole calls, with the
    stores' commits as `commit` says (fenced ones leave with the copies where the wire and device allow:
    their `to_send` is then negative, the commit sent before the copies ended)."""
    blocks_per_group = chunks + 1
    num_blocks = blocks_per_group * len(layout.groups) * 2
    pools = vllm_pools(layout, num_blocks, device)
    fill_random(pools, 0)
    alloc = BlockAllocator(num_blocks)
    src = [alloc.allocate(blocks_per_group) for _ in layout.groups]
    dst = [alloc.allocate(blocks_per_group) for _ in layout.groups]
    rng = np.random.default_rng(chunks)
    salt = f"fixed-cost-{commit}-{next(_ROWS)}"  # a namespace per row: a later row (same mode too) finds none
    with KVTransfer(endpoint, layout, pools, TransferConfig(commit=commit, salt=salt)) as kv:
        ct = kv.chunk_tokens
        fresh = iter(range(1 << 30))

        def tokens() -> np.ndarray:  # a prompt no earlier round stored: every store moves every object
            t = rng.integers(0, 150_000, chunks * ct + 1)
            t[0] = next(fresh)
            return t

        out, objects = _step_costs(kv, layout, src, tokens(), rounds, device)
        out.update(_whole_stores(kv, src, tokens, fresh, objects, rounds))
        stored = tokens()[:-1]  # whole chunks: the prepare beside a load adds one more
        kv.store("L", stored, src).wait_committed(30)
        kv.end_session("L")
        out.update(_loads(kv, stored, dst, rounds, src, lambda: rng.integers(0, 150_000, ct + 1)))
    return out


def profile_issue(endpoint: str, layout: ModelLayout, chunks: int, rounds: int, device: str, top: int) -> str:
    """cProfile of what queues a prepared store's and a load's copies (plan bound or built, copies issued),
    on this thread, `rounds` times each; the copies are waited for outside the profile."""
    import cProfile
    import io
    import pstats

    blocks_per_group = chunks + 1
    num_blocks = blocks_per_group * len(layout.groups) * 2
    pools = vllm_pools(layout, num_blocks, device)
    alloc = BlockAllocator(num_blocks)
    src = [alloc.allocate(blocks_per_group) for _ in layout.groups]
    tokens = np.random.default_rng(chunks).integers(0, 150_000, chunks * layout.default_chunk_tokens() + 1)
    prof = cProfile.Profile()
    with KVTransfer(endpoint, layout, pools) as kv:
        prep = kv.prepare_store("i", tokens, block_ids=src)
        reply = prep.wait(30)
        jobs = kv._object_blocks(reply.slots, src)
        assert isinstance(kv.wire, DirectWire)  # the default format, shm
        triples = kv.wire.slots(jobs)
        assert prep.pages is not None

        def profiled(kind: Literal["store", "load"], direction: Literal["gather", "scatter"], planned) -> None:
            for _ in range(rounds):
                h = TransferHandle(kind, "i")
                prof.enable()
                issued = kv.copies.issue(h, direction, triples, pages=planned)
                prof.disable()
                kv.copies.wait(h, issued)

        # what the library runs (PageCopies.issue): a prepared store binds its planned pages, a load builds its plan
        profiled("store", "gather", prep.pages)
        profiled("load", "scatter", None)
        kv.client.call(P.AbortStore(engine=kv.engine_id, reservation=reply.reservation))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


IDLE_GAPS_S = (0.0, 0.0005, 0.002, 0.005, 0.02)


def idle_round_trips(endpoint: str, rounds: int) -> dict[str, float]:
    """p50 microseconds of a Health round trip after the client and server sat idle for each gap: what a
    commit pays after its copies (the processes' threads and ZMQ's I/O threads sleep meanwhile)."""
    out: dict[str, float] = {}
    with CacheClient(endpoint, timeout_s=30) as c:
        for gap in IDLE_GAPS_S:
            spans = []
            for _ in range(rounds):
                if gap:
                    time.sleep(gap)
                t0 = time.perf_counter()
                c.call(P.Health())
                spans.append(time.perf_counter() - t0)
            out[f"after {gap * 1e3:g} ms idle"] = statistics.median(spans) * 1e6
    return out


def commit_latencies(endpoint: str, rounds: int) -> dict[str, float]:
    """p50 microseconds from the last byte of a store landing in the arena to its commit's answer in the
    waiting thread, per simulated copy time (the gaps). A "copier" thread stands for the GPU and the route's
    worker: it sleeps the gap, writes the slots, then for the classic commit sends it (a round trip after the
    copies, both sides idle meanwhile) and hands the answer over, as the worker does; for a fenced commit,
    sent by the waiting thread before the copies, it writes the fence word and the server answers once it
    sees it. Both hand the answer to the waiting thread once. The CPU writes what the copy engine writes on
    CUDA: this is the protocol's part, not the copies'."""
    import threading
    from concurrent.futures import Future

    from hybridkv.memory.arena import map_arena
    from hybridkv.model.keys import chunk_keys

    layout = small_pages(preset_layout("tiny-hybrid"), 64)
    out: dict[str, float] = {}
    with CacheClient(endpoint, timeout_s=30) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=0, tp_rank=0, salt="commit-latency", name=""))
        arena = np.frombuffer(map_arena(reg.arena_path, reg.arena_bytes), dtype=np.uint8)
        ct = layout.default_chunk_tokens()
        fresh = iter(range(1 << 30))

        def copier(prep: P.Prepared, commit: P.CommitStore, gap: float, fenced: bool, t0: list[float],
                   answer: Future) -> None:
            time.sleep(gap)
            for sl in prep.slots:
                arena[sl.offset:sl.offset + sl.length] = 7
            if fenced:
                t0.append(time.perf_counter())
                arena[prep.fence:prep.fence + 8] = np.frombuffer(prep.reservation.to_bytes(8, "little"), np.uint8)
                return
            t0.append(time.perf_counter())
            try:
                answer.set_result(c.call(commit))
            except Exception as e:  # noqa: BLE001 - handed to the waiting thread
                answer.set_exception(e)

        for gap in IDLE_GAPS_S:
            for mode in ("after_copies", "fenced"):
                spans = []
                for _ in range(rounds):
                    keys = chunk_keys(reg.namespace, np.full(ct, next(fresh), dtype=np.int64), ct)
                    prep, _ = c.call(P.PrepareStore(engine=reg.engine, request="c", keys=keys,
                                                    objects=[(0, g) for g in range(len(layout.groups))]))
                    fenced = mode == "fenced"
                    commit = P.CommitStore(engine=reg.engine, reservation=prep.reservation, format="shm",
                                           fenced=fenced)
                    t0: list[float] = []
                    answer: Future = c.submit(commit) if fenced else Future()
                    th = threading.Thread(target=copier, args=(prep, commit, gap, fenced, t0, answer))
                    th.start()
                    reply = answer.result(30)[0]
                    spans.append(time.perf_counter() - t0[0])
                    th.join()
                    assert isinstance(reply, P.Committed), reply
                    c.call(P.EndSession(engine=reg.engine, request="c"))
                out[f"{mode} after {gap * 1e3:g} ms copies"] = statistics.median(spans) * 1e6
        c.call(P.Unregister(engine=reg.engine))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m hybridkv_bench.microbench.fixed_cost",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 71])
    ap.add_argument("--page-bytes", type=int, default=64, help="0: the presets' own pages")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--l1-gib", type=float, default=0.25)
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    ap.add_argument("--commit", nargs="+", choices=COMMIT_MODES, default=list(COMMIT_MODES),
                    help="the stores' commit modes to profile, each its own row (default: both)")
    ap.add_argument("--presets", nargs="+", default=[f"{n}:{tp}" for n, tp in PRESETS], metavar="NAME:TP",
                    help="the layouts to profile (default: " + " ".join(f"{n}:{tp}" for n, tp in PRESETS) + ")")
    gaps = ", ".join(f"{g * 1e3:g}" for g in IDLE_GAPS_S)
    ap.add_argument("--idle-rt", action="store_true", help=f"instead: a round trip's p50 after idle gaps of {gaps} ms")
    ap.add_argument("--commit-latency", action="store_true",
                    help="instead: last byte in the arena -> commit answered, classic vs fenced, after copies of "
                         f"{gaps} ms (the protocol's part, on any machine)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="TOP",
                    help="instead: cProfile the queueing of a prepared store's and a load's copies, top TOP lines")
    ap.add_argument("--dma-batch", choices=["on", "off"], default="on", help="off: CUDA copies not batched")
    ap.add_argument("--first-slice-runs", type=int, default=None, metavar="N",
                    help="a short plan's first N runs in a driver call of their own (copy_dma.FIRST_SLICE_RUNS; "
                         "0: one call; default: the library's)")
    args = ap.parse_args(argv)
    cuda_batch.set_enabled(args.dma_batch == "on")
    if args.first_slice_runs is not None:
        if args.first_slice_runs < 0:
            ap.error(f"--first-slice-runs must be >= 0, got {args.first_slice_runs}")
        if not hasattr(copy_dma, "FIRST_SLICE_RUNS"):
            ap.error("--first-slice-runs: this tree's copy_dma has no FIRST_SLICE_RUNS")
        copy_dma.FIRST_SLICE_RUNS = args.first_slice_runs
    if args.rounds < 1 or args.page_bytes < 0 or args.page_bytes % 16 or any(c < 1 for c in args.chunks):
        ap.error("--rounds and --chunks must be >= 1, --page-bytes 0 or a multiple of 16")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    try:
        presets = [(name, int(tp)) for name, tp in (p.rsplit(":", 1) for p in args.presets)]
    except ValueError:
        ap.error(f"--presets takes NAME:TP, got {args.presets}")
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    server = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=int(args.l1_gib * GIB)))
    try:
        if args.commit_latency:
            row = commit_latencies(server.endpoint, args.rounds)
            print(json.dumps({"commit_latency_p50_us": row}) if args.json else
                  "Last byte -> commit answered (p50 us): " + "  ".join(f"{k} {v:.0f}" for k, v in row.items()))
            return 0
        if args.idle_rt:
            row = idle_round_trips(server.endpoint, args.rounds)
            print(json.dumps({"idle_rt_p50_us": row}) if args.json else
                  "Health round trip (p50 us): " + "  ".join(f"{k} {v:.0f}" for k, v in row.items()))
            return 0
        for name, tp in presets:
            layout = preset_layout(name, tp)
            if args.page_bytes:
                layout = small_pages(layout, args.page_bytes)
            for chunks in args.chunks:
                if args.cprofile:
                    print(f"== {name} TP{tp} {chunks} chunks: store bind + issue, then load build + issue, "
                          f"{args.rounds} rounds each")
                    print(profile_issue(server.endpoint, layout, chunks, args.rounds, args.device, args.cprofile))
                    continue
                for commit in args.commit:
                    row = profile(server.endpoint, layout, chunks, args.rounds, args.device, commit)
                    if args.json:
                        print(json.dumps({"preset": name, "tp": tp, "chunks": chunks, "device": args.device,
                                          "commit": commit, "page_bytes": layout.groups[0].page_bytes, "p50_us": row}))
                    else:
                        print(f"{name} TP{tp} {chunks} chunks, commit {commit} (p50 us): " +
                              "  ".join(f"{k} {v:.0f}" for k, v in row.items()))
                    sys.stdout.flush()
    finally:
        server.close()
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
