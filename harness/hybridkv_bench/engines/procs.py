"""Engines of a multi-engine workload as processes of their own; each runs its requests with the request step
that engines in threads run too (`engines.step.run_request`).

Threads of one Python process serialise on its GIL: rank engines in threads wait for it between a store's
submit and its first copy, their loads start apart, and together they stay below the link's ceiling (the
H200 figures are in harness/README.md). vLLM runs its TP ranks as processes; with `engines_as = "processes"` (the
default for the sim engine on CUDA, `Scenario.engines_in_processes`) so does the runner. Each engine is a
child started with `spawn` (CUDA cannot fork) that builds its own CacheClient, KVTransfer, pools (on the
device the runner places it on) and SimEngine, then says it is ready: start-up (importing torch, mapping and
registering the arena, allocating pools) ends before the case's first repeat and is never timed.

A repeat (`EngineProcs.repeat`): the last engine of each namespace `Clear`s it (an engine id is bound to the
connection that registered it), the runner takes the repeat's origin (perf_counter: CLOCK_MONOTONIC on
Linux, one clock for every process of the host, so every engine's `store_start_s` / `load_start_s` count
from one instant) and tells every engine to run; each runs its requests of each phase, waits at a barrier
shared by all engines between phases, and sends its rows back. The per-phase `align` barriers make aligned
transfers start together, as in threads.

The hit check is as strict as in threads, where engines of one rank (data-parallel replicas beyond tp)
share one `ExpectedHits`: here each engine keeps its rank's, and after each phase's barrier adds what the
other engines of its rank stored in that phase. Within a phase an engine sees only its own stores; a
shared oracle holds nothing more there, because the engines of one rank never share a prefix within a
phase (that would make a hit depend on which store committed first: `rank_overlap` refuses such a plan).

Failures: an engine that raises sends its error, then breaks the barriers so that its partners stop instead
of waiting; the runner fails the case with that error, naming the engine. An engine that exits unasked
(killed, crashed) or a server that exits is seen at once (the runner waits on every engine's pipe and exit
together and polls the server), and the engines left are stopped: asked first, terminated after a short
grace. Children ignore SIGINT (Ctrl-C reaches the runner, which stops them) and exit when the runner's
process is gone.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from hybridkv.engine.client import CacheClient
from hybridkv.engine.config import TransferConfig
from hybridkv.wire import protocol as P

from hybridkv_bench.engines.base import CLIENT_TIMEOUT_S
from hybridkv_bench.engines.pools import EnginePools
from hybridkv_bench.engines.sim import SimEngine, sim_transfer
from hybridkv_bench.engines.step import RepeatInfo, abort_all, align_barriers, rank_overlap, request_index, run_request
from hybridkv_bench.metrics import RequestRow
from hybridkv_bench.model_shape import ModelSpec
from hybridkv_bench.prefill import PrefillModel, prefill_seconds
from hybridkv_bench.workloads.base import Plan
from hybridkv_bench.workloads.hits import ExpectedHits

STOP_GRACE_S = 60.0       # a stopped engine finishes its transfers and unregisters within this, or is terminated
FAILED_GRACE_S = 2.0      # the same after a failure: partners of a dead engine wait at a barrier for nobody


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What one engine process needs to build itself and run its requests (pickled to it at spawn)."""

    engine: int
    rank: int
    device: torch.device
    endpoint: str
    model: ModelSpec
    prefill: PrefillModel
    transfer: TransferConfig
    chunk: int
    salt: str
    name: str          # the engine's name on the server: "<workload>/<case>#<engine>"
    case: str
    workload: str
    pool_tokens: int   # the pools hold one request of this many tokens, as the runner's own would
    plan: Plan


class EngineFailed(RuntimeError):
    """An engine process raised, exited unasked, or lost its server; the message says which and why."""


class EngineProcs:
    """The engine processes of one case; `start()`, `repeat()` per repeat, always `close()`."""

    def __init__(self, specs: list[EngineSpec], server_alive=None):
        if rank := rank_overlap(specs[0].plan, specs[0].chunk):
            raise EngineFailed(f"engines as processes keep an oracle per engine: {rank}")
        self.server_alive = server_alive  # () -> bool, polled while waiting (None: an external server)
        ctx = mp.get_context("spawn")
        plan = specs[0].plan
        self._phase = ctx.Barrier(len(specs))
        self._aligned = align_barriers(plan, ctx.Barrier)
        pipes = [ctx.Pipe() for _ in specs]
        self._conns = [a for a, _ in pipes]
        self._procs = [ctx.Process(target=_engine_main, name=f"hkv-engine-{s.engine}", daemon=True,
                                   args=(s, b, self._phase, self._aligned, os.getpid()))
                       for s, (_, b) in zip(specs, pipes, strict=True)]
        self._child_ends = [b for _, b in pipes]  # the children's: closed here once they are started
        self._clearers: list[int] = []
        self._failed = False

    def start(self) -> None:
        """Spawn every engine and wait until each has built itself."""
        with _sigint_ignored():  # inherited through exec: a Ctrl-C is the runner's to handle
            for p in self._procs:
                p.start()
        for end in self._child_ends:
            end.close()
        namespaces = self._gather(range(len(self._procs)), "ready")
        self._clearers = list({ns: e for e, ns in sorted(namespaces.items())}.values())

    def repeat(self, repeat: int) -> list[RequestRow]:
        """One repeat of the plan on every engine, from an empty namespace; its rows in plan order."""
        for e in self._clearers:
            self._send(e, ("clear",))
        self._gather(self._clearers, "cleared")
        origin = time.perf_counter()
        for e in range(len(self._procs)):
            self._send(e, ("run", repeat, origin))
        rows = [row for part in self._gather(range(len(self._procs)), "rows").values() for row in part]
        return sorted(rows, key=lambda r: r.request)

    def close(self) -> None:
        """Stop every engine: asked, then terminated after a grace (short once something failed)."""
        for e, p in enumerate(self._procs):
            if p.is_alive():
                try:
                    self._conns[e].send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + (FAILED_GRACE_S if self._failed else STOP_GRACE_S)
        for p in self._procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in [*self._conns, *self._child_ends]:
            c.close()

    # ---- waiting on the engines --------------------------------------------------------------------

    def _send(self, e: int, msg: tuple) -> None:
        try:
            self._conns[e].send(msg)
        except OSError:
            self._raise(f"{self._who(e)} {_exit_text(self._procs[e])} before it was asked to {msg[0]}")

    def _who(self, e: int) -> str:
        return f"engine {e} (process {self._procs[e].pid})"

    def _raise(self, msg: str) -> None:
        self._failed = True
        raise EngineFailed(msg)

    def _gather(self, engines, want: str) -> dict[int, Any]:
        """Each of `engines`' next answer, which must be `want`; fails at the first error, death or the
        server's exit. A partner's "aborted" waits for the error of the engine that broke the barrier."""
        pending, out, aborted = set(engines), {}, set[int]()
        try:
            while pending - aborted:
                mpc.wait([*self._conns, *(p.sentinel for p in self._procs)], 0.05)
                for e, conn in enumerate(self._conns):
                    while True:
                        try:
                            if not conn.poll():
                                break
                            tag, value = conn.recv()
                        except (EOFError, OSError):  # it died (its pipe closed or reset); its exit status says how
                            self._procs[e].join(1.0)
                            break
                        if tag == "error":
                            self._raise(f"{self._who(e)}: {value}")
                        if tag == "aborted":
                            aborted.add(e)
                        elif tag == want and e in pending:
                            out[e] = value
                            pending.discard(e)
                        else:
                            self._raise(f"{self._who(e)} answered {tag!r} while the runner waited for {want!r}")
                    if not self._procs[e].is_alive():
                        self._raise(f"{self._who(e)} {_exit_text(self._procs[e])}")
                if self.server_alive is not None and not self.server_alive():
                    self._raise("the cache server exited while the engines ran")
            if aborted:
                self._raise(f"engines {sorted(aborted)} stopped at a broken barrier and no engine said why")
        except BaseException:  # Ctrl-C too: close() then gives the engines only the short grace
            self._failed = True
            raise
        return out


def _exit_text(p) -> str:
    code = p.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class _sigint_ignored:
    """SIGINT ignored while children are spawned (main thread only; elsewhere a no-op)."""

    def __enter__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            self._old = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc) -> None:
        if self._main:
            signal.signal(signal.SIGINT, self._old)


# ---- the engine process ---------------------------------------------------------------------------

def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _exit_with(parent: int) -> None:
    """Exit this process when the runner's is gone (SIGKILLed runners run no cleanup)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="hkv-engine-parent", daemon=True).start()


def _build(spec: EngineSpec) -> SimEngine:
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    layout = spec.model.layout()
    client = CacheClient(spec.endpoint, timeout_s=CLIENT_TIMEOUT_S)
    try:
        pools = EnginePools.for_prompts(layout, spec.pool_tokens, spec.device)
        kv = sim_transfer(spec.endpoint, layout, pools.pages, spec.transfer, spec.chunk, spec.rank, spec.salt,
                          spec.name, client)
    except BaseException:
        client.close()
        raise
    prefill = functools.partial(prefill_seconds, spec.prefill, spec.model.config(), spec.model.tp)
    return SimEngine(kv, pools, prefill, timeout_s=CLIENT_TIMEOUT_S)


def _run_repeat(spec: EngineSpec, eng: SimEngine, repeat: int, origin: float, phase_barrier, aligned) -> list:
    plan, e = spec.plan, spec.engine
    oracle = ExpectedHits(spec.chunk, bool(eng.layout.recurrent_groups), spec.transfer.store_policy,
                          spec.transfer.retrieve_policy)
    info = RepeatInfo(spec.case, spec.workload, repeat, spec.chunk, origin)
    index = request_index(plan)
    rows = []
    for step, phase in enumerate(plan.phases):
        rows += [run_request(eng, oracle, r, step, index[id(r)], info, aligned[step]) for r in phase if r.engine == e]
        phase_barrier.wait()
        for r in phase:  # what this rank's other engines stored in the phase, as a shared oracle would hold
            if r.engine != e and plan.ranks[r.engine] == spec.rank:
                oracle.stored(r.tokens)
    return rows


def _engine_main(spec: EngineSpec, conn, phase_barrier, aligned, parent: int) -> None:
    """An engine process: build, say ready, answer clear / run / stop until stopped, close the engine, and
    exit at once: an interpreter that imported torch takes a second or more to tear itself down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with(parent)
    code = 1
    try:
        _serve(spec, conn, phase_barrier, aligned)
        code = 0
    except BaseException:  # the runner could not be told (its pipe is gone): say it here
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(spec: EngineSpec, conn, phase_barrier, aligned) -> None:
    try:
        eng = _build(spec)
    except BaseException as e:
        conn.send(("error", _describe(e)))
        return
    try:
        conn.send(("ready", eng.kv.namespace))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the runner closed (or lost) its end: nothing more will be asked
                return
            if msg[0] == "stop":
                return
            try:
                if msg[0] == "clear":
                    eng.kv.client.call(P.Clear(engine=eng.kv.engine_id))
                    reply: tuple = ("cleared", None)
                else:
                    _, repeat, origin = msg
                    reply = ("rows", _run_repeat(spec, eng, repeat, origin, phase_barrier, aligned))
            except threading.BrokenBarrierError:  # a partner failed; its error is the case's
                reply = ("aborted", None)
            except Exception as exc:
                conn.send(("error", _describe(exc)))
                abort_all([phase_barrier, *aligned])  # partners stop instead of waiting for this engine
                continue
            conn.send(reply)
    finally:
        eng.kv.close()
        eng.kv.client.close()
