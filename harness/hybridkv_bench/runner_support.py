"""The runner's small parts: device and endpoint checks, the server watchdog, the status line, and the
one-line progress headline printed per case (`hybridkv bench`)."""

from __future__ import annotations

import fnmatch
import threading
import time
from pathlib import Path

import torch
from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient, ServerTimeout
from hybridkv.server.launch import ServerProcess

from .results import CaseResult
from .scenario import Case


class BenchError(Exception):
    """A run that cannot start as asked (bad device, endpoint, case filter, run folder)."""


def resolve_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cuda":
        raise BenchError("device 'cuda' asked for, but torch sees no CUDA device")
    return torch.device("cpu")


def check_endpoint(endpoint: str, timeout_s: float = 5.0) -> None:
    """Raise BenchError unless a hybridkv server answers a health request at `endpoint`."""
    if not endpoint.startswith(("ipc://", "tcp://")):
        raise BenchError(f"--server {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
    client = CacheClient(endpoint, timeout_s=timeout_s)
    try:
        client.call(P.Health(), timeout=timeout_s + 1)
    except (ServerTimeout, TimeoutError):
        raise BenchError(f"--server {endpoint}: no hybridkv server answered within {timeout_s:g} s") from None
    finally:
        client.close()


class Watch:
    """Closes the case's client sockets the moment its server exits, so engines fail now, not at a timeout."""

    def __init__(self, server: ServerProcess, clients: list[CacheClient]):
        self.server, self.clients = server, clients
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hkv-bench-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.05):
            if not self.server.alive():
                for c in list(self.clients):
                    c.close()
                return

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join()


class Status:
    """What the runner is doing, for the heartbeat line."""

    def __init__(self) -> None:
        self.label, self.detail, self.since = "", "", time.monotonic()

    def set(self, label: str, detail: str = "") -> None:
        if label != self.label:
            self.since = time.monotonic()
        self.label, self.detail = label, detail


def gpu_index(engine) -> int:
    """The CUDA device index an engine's pages live on; -1 on CPU or for engines without pools."""
    device = getattr(getattr(engine, "pools", None), "device", None)
    return device.index if isinstance(device, torch.device) and device.type == "cuda" else -1


def since(t: float, origin: float) -> float:
    """A perf_counter stamp as seconds from the repeat's start (0.0: not recorded)."""
    return t - origin if t else 0.0


def server_log(folder: Path, label: str) -> Path:
    """Where the server of case `label` ("workload/case") writes its log in run folder `folder`."""
    return folder / "server-logs" / f"{label.replace('/', '--')}.log"


def log_tail(log: Path) -> str:
    """The last non-blank line of a server log, as " (last log line: ...)", or "" when there is none."""
    try:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    except OSError:
        return ""
    return f" (last log line: {lines[-1].strip()})" if lines else ""


def case_selected(pattern: str | None, workload: str, case: Case) -> bool:
    return pattern is None or any(fnmatch.fnmatchcase(n, pattern) for n in (case.name, f"{workload}/{case.name}"))


def _fmt(v, unit: str = "", digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}g}{unit}"


def headline(result: CaseResult, wall_s: float) -> str:
    """One progress line per case: TTFT cold/warm, rates against the ceiling, verification, server cost."""
    if result.status == "failed":
        return f"FAILED ({wall_s:.1f} s): {result.error}"
    m = result.metrics
    vram = "not measured" if m["server_vram_mib"] is None else f"{m['server_vram_mib']:g} MiB"
    mapped = m["server_cuda_mapped"]
    cuda = "not measured" if mapped is None else "yes" if mapped else "no"
    return (f"ok ({wall_s:.1f} s)  TTFT cold {_fmt(m['ttft_cold_s'], ' s')} warm {_fmt(m['ttft_warm_s'], ' s')} "
            f"(x{_fmt(m['ttft_speedup'])})  store {_fmt(m['store_gbps'], ' GB/s')} "
            f"({_fmt(m['store_ceiling_ratio'], '', 2)} of peak)  load {_fmt(m['load_gbps'], ' GB/s')} "
            f"({_fmt(m['load_ceiling_ratio'], '', 2)} of peak)  hit {m['hit_tokens']} tok  "
            f"verified {m['verified_chunks']} corrupt {m['corrupt_chunks']}  server VRAM {vram}, CUDA libs {cuda}"
            + model_headline(m) + prefetch_headline(m))


def prefetch_headline(m: dict) -> str:
    """Warm TTFT per tier of a prefetch comparison, or nothing."""
    if m.get("ttft_warm_l1_s") is None:
        return ""
    return (f"  warm TTFT from L1 {_fmt(m['ttft_warm_l1_s'], ' s')}, from L2 {_fmt(m['ttft_warm_l2_s'], ' s')}, "
            f"from L2 with prefetch {_fmt(m['ttft_warm_l2_prefetch_s'], ' s')} (x{_fmt(m['prefetch_ttft_ratio'])} "
            f"of L1; restore x{_fmt(m['prefetch_restore_ratio'])})")


def model_headline(m: dict) -> str:
    """A real model's measured TTFTs and oracle verdict, or nothing for the simulated engine."""
    if m.get("oracle_pass") is None and m.get("ttft_cold_measured_s") is None:
        return ""
    verdict = "not run" if m.get("oracle_pass") is None else ("PASS" if m["oracle_pass"] is True else "FAIL")
    return (f"  measured TTFT cold {_fmt(m['ttft_cold_measured_s'], ' s')} warm {_fmt(m['ttft_warm_measured_s'], ' s')}"
            f" (x{_fmt(m['ttft_speedup_measured'])})  oracle {verdict} (bitwise {m['logits_bitwise_equal']}, "
            f"max|diff| vs full prefill {_fmt(m['logits_max_abs_diff'])})")
