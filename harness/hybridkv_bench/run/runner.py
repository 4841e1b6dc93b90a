"""The scenario runner behind `hybridkv bench`: every (matrix case, workload) against a fresh cache server.

For each case: start a server process (its own L1 arena, an L2 directory under the run's temp area when
the scenario has an L2), build one engine of the scenario's kind per engine of the workload (`engines.registry`;
several at once: threads of this process, `run.threads`, or a process each, `engines.procs`:
`Scenario.engines_in_processes`), run the warm-up and measured
repeats (each starts from an empty namespace: the engines `Clear` theirs), check every hit against
`ExpectedHits`, sample the server (VRAM by NVML, CUDA libraries mapped, RSS, CPU time, counters), stop it.
A case that raises, or whose server dies (a watchdog closes the engines' sockets at once instead of
waiting for timeouts), is recorded as failed with its error and the run goes on. The copy ceiling is
calibrated once per run. The run folder is written as cases finish; Ctrl-C or SIGTERM stops servers,
removes temp files and leaves run.json marked incomplete.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from hybridkv.engine.client import CacheClient
from hybridkv.engine.transfer import WIRE_FORMATS, TransferConfig
from hybridkv.server.books.config import ServerConfig
from hybridkv.server.front.launch import ServerProcess, start_server
from hybridkv.server.l2.fs_spec import FsL2Spec
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import WireFormat, traits

from hybridkv_bench.engines.base import CLIENT_TIMEOUT_S, Engine, EngineSite, HitMismatch, builder
from hybridkv_bench.engines.pools import EnginePools
from hybridkv_bench.engines.procs import EngineProcs, EngineSpec
from hybridkv_bench.engines.step import RepeatInfo
from hybridkv_bench.metrics import RequestRow, case_metrics
from hybridkv_bench.prefill import prefill_seconds
from hybridkv_bench.results.folder import CaseResult, RunWriter
from hybridkv_bench.results.host import collect_context
from hybridkv_bench.run.options import BenchError, BenchOptions, RunOutcome, torch_device
from hybridkv_bench.run.probes import sample_server
from hybridkv_bench.run.progress import Status, case_selected, headline
from hybridkv_bench.run.server import ServerWatch, log_tail, ping_server, server_log
from hybridkv_bench.run.threads import repeat_in_threads
from hybridkv_bench.scenario.load import ScenarioFile
from hybridkv_bench.scenario.spec import Case, Scenario, expand_matrix
from hybridkv_bench.workloads.base import Plan, WorkloadKind, build_plan, engine_gpus
from hybridkv_bench.workloads.hits import ExpectedHits


class Runner:
    """One run of one scenario; `run()` does it all. See the module doc."""

    def __init__(self, sf: ScenarioFile, options: BenchOptions):
        self.sf, self.opt = sf, options
        scenario = sf.scenario
        if options.device:
            scenario = msgspec.structs.replace(scenario, device=options.device)
            self.sf = sf = ScenarioFile(sf.path, sf.sha256, scenario, sf.scale)
        self.scenario: Scenario = scenario
        self.layout = scenario.model.layout()
        self.cfg = scenario.model.config()
        self.chunk = scenario.model.resolved_chunk_tokens(self.layout)
        self.device = torch_device(scenario.device)
        self.cases = expand_matrix(scenario)
        self.plans = {w.label: build_plan(w, self.chunk, scenario.seed, scenario.model.tp) for w in scenario.workloads}
        self.selected = [(w, c) for w in scenario.workloads for c in self.cases
                         if case_selected(options.cases, w.label, c)]
        if not self.selected:
            raise BenchError(f"--cases {options.cases!r} matches no case of {scenario.name} "
                             f"(cases: {', '.join(c.name for c in self.cases)})")
        if not 0 <= options.planted_slowdown <= 1 or (options.planted_slowdown and scenario.engine != "sim"):
            raise BenchError(f"a planted slowdown is a fraction in 0..1 of the sim engine's transfers, got "
                             f"{options.planted_slowdown:g} with engine {scenario.engine!r}")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.folder = Path(options.out or Path("results", "runs", f"{scenario.name}-{stamp}"))
        self.status = Status()
        self._pools: dict[tuple[int, str], EnginePools] = {}
        self._shared: dict[str, Any] = {}  # what an engine kind builds once per run (a transformers model)
        self._tmp: list[Path] = []
        self._servers: list[ServerProcess] = []
        self._l2_dirs: dict[int, Path] = {}  # each running server's L2 directory, by id(server)
        self._nonce = f"{os.getpid()}-{time.time_ns()}"

    # ---- resources ----------------------------------------------------------------------------------

    def _pools_for(self, engine: int, device: torch.device) -> EnginePools:
        """Pools live for the whole run (allocating GBs per case would be measured by nobody)."""
        key = (engine, str(device))
        if key not in self._pools:
            self._pools[key] = EnginePools.for_prompts(self.layout, self._pool_tokens(engine), device)
        return self._pools[key]

    def _pool_tokens(self, engine: int) -> int:
        """The longest prompt engine `engine` runs in any workload: what its pools hold."""
        return max(p.max_tokens(engine) for p in self.plans.values())

    def engine_devices(self, workload: WorkloadKind) -> list[torch.device]:
        """Where each engine of `workload` runs: on CUDA as `engine_gpus` places it, else all on the CPU."""
        n = len(self.plans[workload.label].ranks)
        if self.device.type != "cuda":
            return [self.device] * n
        try:
            return [torch.device("cuda", g) for g in engine_gpus(workload, torch.cuda.device_count())][:n]
        except ValueError as e:
            raise BenchError(str(e)) from None

    def _mkdtemp(self, prefix: str, parent: Path | None = None) -> Path:
        d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self._tmp.append(d)
        return d

    def _start_server(self, label: str, wire_format: WireFormat) -> ServerProcess:
        srv = self.scenario.server
        sock = self._mkdtemp("hkv-bench-")  # /tmp: ipc:// paths must stay short; mkdtemp makes it 0700
        # only the CUDA-IPC baseline's server may see a GPU: it maps the engine's pages and copies itself
        # admin: the runner reads server-wide Stats around each case (its own private server)
        l2 = l2_dir = None
        if srv.l2_gib > 0:
            parent = Path(srv.l2_dir) if srv.l2_dir else self.folder / ".tmp"
            parent.mkdir(parents=True, exist_ok=True)
            l2_dir = self._mkdtemp("l2-", parent)
            l2 = FsL2Spec(str(l2_dir), srv.l2_bytes)
            if short := l2.disk_shortfall():  # a full disk would drop objects and fail the hit checks, saying nothing
                raise BenchError(f"server.l2_gib {srv.l2_gib:g} needs {srv.l2_bytes / 2**30:.3f} GiB of disk, but "
                                 f"{l2_dir} has {(srv.l2_bytes - short) / 2**30:.3f} GiB free: free some disk, point "
                                 "server.l2_dir at a larger one, or lower server.l2_gib")
        log_path = server_log(self.folder, label)
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "w") as log:
            server = start_server(ServerConfig(endpoint=f"ipc://{sock}/server.sock", l1_bytes=srv.l1_bytes, l2=l2,
                                               client_timeout_s=srv.client_timeout_s, admin=True,
                                               cuda_ipc=traits(wire_format).server_holds_cuda), stderr=log)
        self._servers.append(server)
        if l2_dir is not None:
            self._l2_dirs[id(server)] = l2_dir
        return server

    def _stop_server(self, server: ServerProcess) -> None:
        server.stop()
        server.close()
        self._servers.remove(server)
        l2_dir = self._l2_dirs.pop(id(server), None)
        if l2_dir is not None:  # the next case's L2 gets the disk room this one held
            shutil.rmtree(l2_dir, ignore_errors=True)

    def cleanup(self) -> None:
        """Stop every server this run started and remove its temp dirs (sockets, L2 files)."""
        for s in list(self._servers):
            self._stop_server(s)
        for d in self._tmp:
            shutil.rmtree(d, ignore_errors=True)
        self._tmp.clear()
        shutil.rmtree(self.folder / ".tmp", ignore_errors=True)

    # ---- one case -----------------------------------------------------------------------------------

    def _run_case(self, workload, case: Case) -> tuple[CaseResult, list[RequestRow]]:
        label = f"{workload.label}/{case.name}"
        plan = self.plans[workload.label]
        axes, wire_format = case.axes, case.settings.wire_format

        def failed(msg: str) -> tuple[CaseResult, list[RequestRow]]:
            return CaseResult(name=case.name, workload=workload.label, axes=axes, status="failed", error=msg), []

        if wire_format not in WIRE_FORMATS:
            return failed(f"wire_format {wire_format!r} is not implemented by hybridkv.engine.transfer "
                          f"(it supports {', '.join(WIRE_FORMATS)})")
        salt = f"{label}@{self._nonce}" if self.opt.server else label  # a shared server may hold older runs
        clients: list[CacheClient] = []
        engines: list[Engine] = []
        procs: EngineProcs | None = None  # the engines as processes of their own (engines_in_processes)
        server = watch = control = None
        try:
            server = None if self.opt.server else self._start_server(label, wire_format)
            endpoint = self.opt.server if server is None else server.endpoint
            assert endpoint is not None
            watch = ServerWatch(server, clients) if server else None
            control = CacheClient(endpoint, timeout_s=CLIENT_TIMEOUT_S)
            clients.append(control)
            before, _ = control.call(P.Stats())
            if self.scenario.engines_in_processes(self.device.type, len(plan.ranks)):
                if self.opt.before_retrieve or self.opt.planted_slowdown:
                    raise BenchError("the before_retrieve hook and a planted slowdown act in the runner's process, "
                                     "not in engine processes: set engines_as = 'threads' to use them")
                procs = EngineProcs(self._engine_specs(workload, case, endpoint, salt),
                                    server.alive if server is not None else None)
                procs.start()  # the engines build themselves (pools, arena registration) before any repeat
            else:
                self._build_engines(workload, case, endpoint, salt, server, clients, engines)
            rows = self._repeats(workload, case, engines, procs)
            after, _ = control.call(P.Stats())
            metrics, details = self._measured(rows, plan, server, endpoint, before, after, procs is not None)
            return CaseResult(name=case.name, workload=workload.label, axes=axes, status="ok", metrics=metrics,
                              details=details), rows
        except Exception as e:
            if server is not None and not server.alive():
                tail = log_tail(server_log(self.folder, label))
                return failed(f"server exited with status {server.proc.returncode}{tail}")
            return failed(f"{type(e).__name__}: {e}{l2_losses(control) if isinstance(e, HitMismatch) else ''}")
        finally:
            if watch:
                watch.stop()
            if procs is not None:
                procs.close()
            for eng in engines:
                eng.close()
            for c in clients:
                c.close()
            if server is not None:
                self._stop_server(server)

    def _repeats(self, workload: WorkloadKind, case: Case, engines: list[Engine],
                 procs: EngineProcs | None) -> list[RequestRow]:
        """The warm-up and measured repeats of a case, by its engines in this process or as processes."""
        label, plan, settings = f"{workload.label}/{case.name}", self.plans[workload.label], case.settings
        has_state = bool(self.layout.recurrent_groups)
        rows: list[RequestRow] = []
        for repeat in range(-self.scenario.warmup, self.scenario.repeats):
            self.status.set(label, f"repeat {repeat + 1} of {self.scenario.repeats}" if repeat >= 0
                            else f"warm-up {repeat + self.scenario.warmup + 1} of {self.scenario.warmup}")
            if procs is not None:
                rows += procs.repeat(repeat)
                continue
            for eng in {eng.kv.namespace: eng for eng in engines}.values():
                # an engine id is bound to the connection that registered it: clear through that one
                eng.kv.client.call(P.Clear(engine=eng.kv.engine_id))
            oracles = {rank: ExpectedHits(self.chunk, has_state, settings.store_policy, settings.retrieve_policy)
                       for rank in set(plan.ranks)}
            info = RepeatInfo(case.name, workload.label, repeat, self.chunk, time.perf_counter())
            rows += repeat_in_threads(engines, oracles, plan, info)
        return rows

    def _measured(self, rows: list[RequestRow], plan: Plan, server: ServerProcess | None, endpoint: str,
                  before: P.StatsResult, after: P.StatsResult, in_processes: bool) -> tuple[dict, dict]:
        """A case's metrics and details: its rows, the server's counters around it, the server's sample."""
        # Counters and gauges as the server reports them after the case; on a shared server, with the
        # values from before it too (counters of other clients may have moved meanwhile).
        details: dict = {"server_counters": after.counters}
        if len(plan.ranks) > 1:
            details["engines_as"] = "processes" if in_processes else "threads"
        if server is None:
            details["server_counters_before"] = before.counters
        if server is not None:
            sample = sample_server(server.pid, os.getpid())
            server_metrics = sample.metrics()
            details["server_cuda_libraries"] = sample.cuda_libraries
        else:
            server_metrics = {}
            details["server"] = f"external ({endpoint}): VRAM, CUDA libraries, RSS and CPU not measured"
        metrics = case_metrics(rows, self.calibration, server_metrics)
        store_done = sorted(r.store_done_s for r in rows if r.repeat >= 0 and r.bytes_stored)
        details["store_done_s_p50"] = store_done[len(store_done) // 2] if store_done else None
        return metrics, details

    def _build_engines(self, workload: WorkloadKind, case: Case, endpoint: str, salt: str, server: ServerProcess | None,
                       clients: list[CacheClient], engines: list[Engine]) -> None:
        """The workload's engines in this process, appended to `engines` (their clients to `clients`)."""
        plan, label, hook = self.plans[workload.label], f"{workload.label}/{case.name}", self.opt.before_retrieve
        devices = self.engine_devices(workload)
        build = builder(self.scenario.engine)

        def client() -> CacheClient:
            clients.append(c := CacheClient(endpoint, timeout_s=CLIENT_TIMEOUT_S))
            return c

        transfer = self._transfer(case)
        for e, rank in enumerate(plan.ranks):
            site = EngineSite(transformers=self.scenario.transformers, cfg=self.cfg, layout=self.layout,
                              chunk=self.chunk, endpoint=endpoint, transfer=transfer, salt=salt, name=f"{label}#{e}",
                              engine=e, rank=rank,
                              device=devices[e], run_device=self.device, max_tokens=plan.max_tokens(e),
                              timeout_s=CLIENT_TIMEOUT_S, prefill=self._prefill,
                              pools=functools.partial(self._pools_for, e, devices[e]), client=client,
                              before_retrieve=(lambda hit: hook(hit, server)) if hook else None, shared=self._shared,
                              planted_slowdown=self.opt.planted_slowdown)
            engines.append(build(site))

    def _engine_specs(self, workload: WorkloadKind, case: Case, endpoint: str, salt: str) -> list[EngineSpec]:
        """What each engine process of the workload builds: the placement and pool size threads get."""
        plan, label = self.plans[workload.label], f"{workload.label}/{case.name}"
        return [EngineSpec(engine=e, rank=rank, device=device, endpoint=endpoint, model=self.scenario.model,
                           prefill=self.scenario.prefill, transfer=self._transfer(case), chunk=self.chunk, salt=salt,
                           name=f"{label}#{e}", case=case.name, workload=workload.label,
                           pool_tokens=self._pool_tokens(e), plan=plan)
                for e, (rank, device) in enumerate(zip(plan.ranks, self.engine_devices(workload), strict=True))]

    def _transfer(self, case: Case) -> TransferConfig:
        """The case's transfer settings (its axes and the scenario's commit mode)."""
        return case.transfer

    def _prefill(self, new: int, cached: int) -> float:
        return prefill_seconds(self.scenario.prefill, self.cfg, self.scenario.model.tp, new, cached)

    # ---- the run ------------------------------------------------------------------------------------

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.opt.heartbeat_s):
            s = self.status
            print(f"  ... {s.label}: {s.detail}, {time.monotonic() - s.since:.0f} s in", file=self.opt.progress,
                  flush=True)

    def run(self) -> RunOutcome:
        from hybridkv_bench.calibration.copies import calibrate

        out = self.opt.progress
        if self.opt.server:
            ping_server(self.opt.server)
        record = self.sf.record()
        context = collect_context()
        context["cases_glob"] = self.opt.cases
        if self.opt.planted_slowdown:
            context["planted_slowdown"] = self.opt.planted_slowdown
        try:
            writer = RunWriter(self.folder, record, context)
        except Exception as e:
            raise BenchError(str(e)) from None
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(stop,), name="hkv-bench-heartbeat", daemon=True)
        failed: list[str] = []
        try:
            for w in self.scenario.workloads:
                self.engine_devices(w)  # a placement naming a missing GPU fails before any case runs
            beat.start()
            self.status.set("calibration", f"copy ceiling on {self.device.type}")
            cal = calibrate(self.device.type)
            self.calibration = msgspec.to_builtins(cal)
            writer.set_calibration(self.calibration)
            print(f"hybridkv bench {self.scenario.name}: {len(self.selected)} cases on {self.device}, "
                  f"ceiling D2H {cal.d2h_peak_gbps:.2f} / H2D {cal.h2d_peak_gbps:.2f} GB/s ({cal.method}); "
                  f"run folder {self.folder}", file=out, flush=True)
            for i, (workload, case) in enumerate(self.selected, 1):
                t0 = time.perf_counter()
                self.status.set(f"{workload.label}/{case.name}", "starting")
                result, rows = self._run_case(workload, case)
                writer.add_requests(rows)
                writer.add_case(result)
                if result.status == "failed":
                    failed.append(result.key)
                print(f"[{i}/{len(self.selected)}] {result.key}: {headline(result, time.perf_counter() - t0)}",
                      file=out, flush=True)
            writer.finish()
        except BaseException:
            writer.close()  # run.json stays complete=false
            raise
        finally:
            stop.set()
            self.cleanup()
        return RunOutcome(folder=self.folder, cases=len(self.selected), failed=failed)


def l2_losses(control: CacheClient | None) -> str:
    """Why a hit may have come short when L2 writes failed (a full disk): the server's counts, or ""."""
    try:
        c = control.call(P.Stats())[0].counters if control is not None else {}
    except Exception:
        return ""
    failures, dropped = c.get("l2_spill_failures", 0), c.get("l1_dropped_unspilled", 0)
    if not failures and not dropped:
        return ""
    return (f"; the server's L2 writes failed {failures} times and it dropped {dropped} objects from L1 with no "
            "L2 copy (its log says why: a full disk?)")


def run_bench(sf: ScenarioFile, options: BenchOptions | None = None) -> RunOutcome:
    """Run a scenario; SIGTERM is turned into KeyboardInterrupt so that it cleans up as Ctrl-C does."""
    runner = Runner(sf, options or BenchOptions())
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None

    def on_term(signum, frame):
        raise KeyboardInterrupt

    if main:
        signal.signal(signal.SIGTERM, on_term)
    try:
        return runner.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
