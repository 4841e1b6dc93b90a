"""What `hybridkv bench` prints while it runs: the status a heartbeat reports, which cases `--cases` selects,
and the one-line headline per case."""

from __future__ import annotations

import fnmatch
import time

from hybridkv_bench.results.folder import CaseResult
from hybridkv_bench.scenario.spec import Case


class Status:
    """What the runner is doing, for the heartbeat line."""

    def __init__(self) -> None:
        self.label, self.detail, self.since = "", "", time.monotonic()

    def set(self, label: str, detail: str = "") -> None:
        if label != self.label:
            self.since = time.monotonic()
        self.label, self.detail = label, detail


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
