"""Metric names and how a case's metrics are computed from its per-request rows.

One function, `case_metrics`, turns request rows (what requests.csv holds), the run's calibration
and a server sample into a case's metrics. The runner calls it to fill run.json; the report calls
it again on the CSV and flags any case whose stored metrics differ, so no figure is taken on trust.

Definitions (seconds; GB/s = 1e9 B/s). "Measured" rows are those with repeat >= 0 (warm-up rows
carry negative repeat numbers and count only toward verified/corrupt chunks: corruption is never
hidden by calling it warm-up).
- ttft_cold_s / ttft_warm_s: p50 of ttft_s over cold / warm rows; `_p90`, `_p99` beside (linear
  interpolation between order statistics, numpy's default).
- lookup_s: p50 over all rows. store_s / load_s: p50 over rows that stored / loaded any bytes.
- store_gbps / load_gbps: total bytes over total seconds of those rows (bytes-weighted, not a mean
  of per-request rates).
- store_copy_gbps / load_copy_gbps: the same bytes over the copy alone (first page copy enqueued to
  the last one finished), without round trips and hand-offs: the gap to store_gbps / load_gbps is
  the transfer's fixed cost, the gap to the ceiling the copy's.
- prefill_s: p50 of the modeled prefill of cold rows: the compute a hit saves.
- bytes_stored, bytes_loaded, hit_tokens, shared_tokens: sums over measured rows (all repeats); shared_tokens
  counts the whole chunks each request shares with what was stored before it (what an attention-only model
  resumes from). hit_share = hit_tokens / shared_tokens (None when nothing was shared): below 1, hits were lost
  (a prefix stored without its recurrent state at the chunk where the request parts from it).
- verified_chunks, corrupt_chunks: sums over every row, warm-up included.
- store_ceiling_ratio = store_gbps / d2h_peak_gbps; load_ceiling_ratio = load_gbps / h2d_peak_gbps;
  ttft_speedup = ttft_cold_s / ttft_warm_s.
- aggregate_store_gbps / aggregate_load_gbps: for steps (barrier phases of one repeat) in which two or
  more engines stored (loaded), their bytes over the span from the first start to the last end;
  summed over such steps. Ratios against the one link's ceiling when every engine shares one GPU, against
  the calibration's all-GPUs-at-once ceiling when they are spread over several (the `gpu` column).
- engine_store_gbps_min / _max (load likewise): with several engines, the slowest and fastest engine's
  own rate (its bytes over its seconds): the spread behind the aggregate.
- bidir_gbps: for steps in which one engine stored while another loaded, bytes of both over that span;
  bidir_ceiling_ratio = bidir_gbps / bidir_peak_gbps (D2H and H2D at once, calibrated).
With a real model (the `transformers` engine; None for the simulated one):
- ttft_cold_measured_s / ttft_warm_measured_s: p50 of ttft_measured_s over cold / warm rows (cold: the
  prefill measured; warm: lookup + load + the continuation's prefill, all measured).
- ttft_speedup_measured: min(ttft_cold_measured_s, ttft_cold_s) / ttft_warm_measured_s: the smaller cold
  figure, so the headline never flatters.
- logits_max_abs_diff: the largest |restored - full prefill| logit difference over warm rows;
  logits_bitwise_equal / oracle_pass: every warm row's restored continuation equalled the in-memory split /
  passed the oracle (a False fails the case in the gate).
Prefetch from L2 (a multi_turn workload with prefetch = "compare"; None otherwise), over measured warm
rows of each tier (`l1`: the prefix still in L1; `l2`: brought back from L2 by the lookup; `l2_prefetch`:
brought back by a prefetch hint sent at the start of the think time):
- ttft_warm_l1_s / ttft_warm_l2_s / ttft_warm_l2_prefetch_s: p50 of ttft_s per tier.
- restore_l1_s / restore_l2_s / restore_l2_prefetch_s: p50 of lookup_s + load_s per tier (the TTFT
  without its modeled prefill: what the tiers differ in).
- prefetch_ttft_ratio = ttft_warm_l2_prefetch_s / ttft_warm_l1_s (the target: <= 1.1);
  prefetch_restore_ratio the same for restore; l2_ttft_ratio = ttft_warm_l2_s / ttft_warm_l1_s (without
  the hint, the reference).
A metric that cannot be computed (no warm rows, no NVML) is None, written as null: never 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
import numpy as np

Number = float | int | bool | None

TTFT_METRICS = tuple(f"ttft_{p}_s{s}" for p in ("cold", "warm") for s in ("", "_p90", "_p99"))
REQUEST_METRICS = (
    *TTFT_METRICS, "lookup_s", "store_s", "load_s", "store_gbps", "load_gbps", "store_copy_gbps",
    "load_copy_gbps", "prefill_s",
    "bytes_stored", "bytes_loaded", "hit_tokens", "shared_tokens", "hit_share", "verified_chunks", "corrupt_chunks",
)
CONCURRENT_METRICS = ("aggregate_store_gbps", "aggregate_load_gbps", "bidir_gbps", "engine_store_gbps_min",
                      "engine_store_gbps_max", "engine_load_gbps_min", "engine_load_gbps_max")
CALIBRATION_METRICS = ("d2h_peak_gbps", "h2d_peak_gbps", "bidir_peak_gbps")
SERVER_METRICS = ("server_vram_mib", "server_cuda_mapped", "server_rss_mib", "server_cpu_s")
RATIO_METRICS = ("store_ceiling_ratio", "load_ceiling_ratio", "ttft_speedup")
MODEL_METRICS = ("ttft_cold_measured_s", "ttft_warm_measured_s", "ttft_speedup_measured", "logits_max_abs_diff",
                 "logits_bitwise_equal", "oracle_pass")
CONCURRENT_RATIO_METRICS = ("aggregate_store_ceiling_ratio", "aggregate_load_ceiling_ratio", "bidir_ceiling_ratio")
PREFETCH_TIERS = ("l1", "l2", "l2_prefetch")
PREFETCH_METRICS = (*(f"ttft_warm_{t}_s" for t in PREFETCH_TIERS), *(f"restore_{t}_s" for t in PREFETCH_TIERS),
                    "prefetch_ttft_ratio", "prefetch_restore_ratio", "l2_ttft_ratio")
METRICS = (*REQUEST_METRICS, *CALIBRATION_METRICS, *SERVER_METRICS, *RATIO_METRICS, *CONCURRENT_METRICS,
           *CONCURRENT_RATIO_METRICS, *MODEL_METRICS, *PREFETCH_METRICS)

# How each metric improves; the gate's --write-baseline and the report read this.
HIGHER_IS_BETTER = frozenset({"store_gbps", "load_gbps", "store_copy_gbps", "load_copy_gbps",
                              "hit_tokens", "hit_share", "verified_chunks",
                              "store_ceiling_ratio", "load_ceiling_ratio", "ttft_speedup",
                              "ttft_speedup_measured",
                              *CONCURRENT_METRICS, *CONCURRENT_RATIO_METRICS})


class RequestRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of one case: a line of requests.csv. Times in seconds, prefill_s modeled."""

    case: str
    workload: str
    repeat: int  # < 0: warm-up
    request: int
    phase: Literal["cold", "warm"]
    prompt_tokens: int
    hit_tokens: int
    shared_tokens: int = 0  # whole chunks shared with what was stored before it, in tokens (0: not recorded)
    lookup_s: float
    store_s: float
    load_s: float
    store_done_s: float = 0.0  # store submitted -> the engine's blocks reusable (`done`); store_s runs to `committed`
    store_copy_s: float = 0.0  # the store's page copies alone (no round trips); 0 when not recorded
    store_span_s: float = 0.0  # prepare submitted -> committed: store_s plus the prepare made ahead (0: not recorded)
    load_copy_s: float = 0.0   # the retrieve's page copies alone (for raw/legacy: decode and copy)
    prefill_s: float
    ttft_s: float
    # A real model's request (None for the simulated engine): see MODEL_COLUMNS
    prefill_measured_s: float | None = None  # the model's forwards (cold: whole prompt; warm: continuation)
    ttft_measured_s: float | None = None     # cold: prefill_measured_s; warm: lookup + load + prefill_measured_s
    adapter_s: float | None = None           # copies between transformers' cache and the pages (in no TTFT)
    forward_alone_s: float | None = None     # warm: the continuation from an in-memory cache, no load
    warm_pipeline_ratio: float | None = None  # warm: ttft_measured_s / max(load_s, forward_alone_s)
    logits_max_abs_diff: float | None = None
    logits_bitwise_equal: bool | None = None
    oracle_pass: bool | None = None
    bytes_stored: int
    bytes_loaded: int
    # Concurrency (multi-engine workloads): which engine and GPU ran it, in which barrier step, and when
    # its load and store started, in seconds from the repeat's start (so windows of one step compare).
    engine: int = 0
    gpu: int = -1  # CUDA device index; -1: CPU
    step: int = 0
    load_start_s: float = 0.0
    store_start_s: float = 0.0
    tier: str = ""  # multi_turn with prefetch = "compare": l1, l2 or l2_prefetch (warm rows); "" otherwise
    verified_chunks: int  # the last two columns: tests and readers of requests.csv find them there
    corrupt_chunks: int


# Columns a real-model engine's result carries beyond the simulated engine's (the runner copies them).
MODEL_COLUMNS = ("prefill_measured_s", "ttft_measured_s", "adapter_s", "forward_alone_s", "warm_pipeline_ratio",
                 "logits_max_abs_diff",
                 "logits_bitwise_equal", "oracle_pass")
REQUEST_COLUMNS: tuple[str, ...] = RequestRow.__struct_fields__


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _rate(rows: list[RequestRow], nbytes: str, seconds: str) -> float | None:
    moved = [r for r in rows if getattr(r, nbytes) > 0]
    total_s = sum(getattr(r, seconds) for r in moved)
    if not moved or total_s <= 0:
        return None
    return sum(getattr(r, nbytes) for r in moved) / total_s / 1e9


def _ratio(a: Number, b: Number) -> float | None:
    return float(a) / float(b) if a is not None and b else None


def _span_rate(rows: list[RequestRow], kinds: tuple[str, ...], need) -> float | None:
    """Bytes over the span of their windows, per (repeat, step) whose windows satisfy `need`, summed."""
    steps: dict[tuple[int, int], list[tuple[RequestRow, str]]] = {}
    for r in rows:
        for k in kinds:
            if (r.bytes_loaded if k == "load" else r.bytes_stored) > 0:
                steps.setdefault((r.repeat, r.step), []).append((r, k))
    moved, span = 0, 0.0
    for windows in steps.values():
        if not need(windows):
            continue
        starts = [getattr(r, f"{k}_start_s") for r, k in windows]
        ends = [getattr(r, f"{k}_start_s") + getattr(r, f"{k}_s") for r, k in windows]
        moved += sum(r.bytes_loaded if k == "load" else r.bytes_stored for r, k in windows)
        span += max(ends) - min(starts)
    return moved / span / 1e9 if moved and span > 0 else None


def _engine_spread(rows: list[RequestRow], nbytes: str, seconds: str) -> tuple[float | None, float | None]:
    """The slowest and fastest engine's own rate when two or more engines moved bytes."""
    rates = [r for e in sorted({r.engine for r in rows}) if (r := _rate([x for x in rows if x.engine == e],
                                                                          nbytes, seconds)) is not None]
    return (min(rates), max(rates)) if len(rates) > 1 else (None, None)


def _several_engines(windows) -> bool:
    return len({r.engine for r, _ in windows}) > 1


def _store_beside_load(windows) -> bool:
    stores = {r.engine for r, k in windows if k == "store"}
    loads = {r.engine for r, k in windows if k == "load"}
    return bool(stores) and bool(loads) and len(stores | loads) > 1


def case_metrics(rows: Iterable[RequestRow], calibration: Mapping | None = None,
                 server: Mapping[str, Number] | None = None) -> dict[str, Number]:
    """Every metric of one case (one matrix point on one workload) from its request rows."""
    rows = list(rows)
    measured = [r for r in rows if r.repeat >= 0]
    m: dict[str, Number] = {}
    for phase in ("cold", "warm"):
        ttft = [r.ttft_s for r in measured if r.phase == phase]
        m[f"ttft_{phase}_s"] = _p(ttft, 50)
        m[f"ttft_{phase}_s_p90"] = _p(ttft, 90)
        m[f"ttft_{phase}_s_p99"] = _p(ttft, 99)
    m["lookup_s"] = _p([r.lookup_s for r in measured], 50)
    m["store_s"] = _p([r.store_s for r in measured if r.bytes_stored > 0], 50)
    m["load_s"] = _p([r.load_s for r in measured if r.bytes_loaded > 0], 50)
    m["store_gbps"] = _rate(measured, "bytes_stored", "store_s")
    m["load_gbps"] = _rate(measured, "bytes_loaded", "load_s")
    m["store_copy_gbps"] = _rate(measured, "bytes_stored", "store_copy_s")
    m["load_copy_gbps"] = _rate(measured, "bytes_loaded", "load_copy_s")
    m["prefill_s"] = _p([r.prefill_s for r in measured if r.phase == "cold"], 50)
    for f in ("bytes_stored", "bytes_loaded", "hit_tokens", "shared_tokens"):
        m[f] = sum(getattr(r, f) for r in measured)
    m["hit_share"] = _ratio(m["hit_tokens"], m["shared_tokens"])
    for f in ("verified_chunks", "corrupt_chunks"):
        m[f] = sum(getattr(r, f) for r in rows)
    calibration = calibration or {}
    for f in CALIBRATION_METRICS:
        m[f] = calibration.get(f)
    server = server or {}
    for f in SERVER_METRICS:
        m[f] = server.get(f)
    m["store_ceiling_ratio"] = _ratio(m["store_gbps"], m["d2h_peak_gbps"])
    m["load_ceiling_ratio"] = _ratio(m["load_gbps"], m["h2d_peak_gbps"])
    m["ttft_speedup"] = _ratio(m["ttft_cold_s"], m["ttft_warm_s"])
    m["aggregate_store_gbps"] = _span_rate(measured, ("store",), _several_engines)
    m["aggregate_load_gbps"] = _span_rate(measured, ("load",), _several_engines)
    m["bidir_gbps"] = _span_rate(measured, ("store", "load"), _store_beside_load)
    m["engine_store_gbps_min"], m["engine_store_gbps_max"] = _engine_spread(measured, "bytes_stored", "store_s")
    m["engine_load_gbps_min"], m["engine_load_gbps_max"] = _engine_spread(measured, "bytes_loaded", "load_s")
    spread = len({r.gpu for r in measured}) > 1
    d2h = calibration.get("aggregate_d2h_gbps") if spread else m["d2h_peak_gbps"]
    h2d = calibration.get("aggregate_h2d_gbps") if spread else m["h2d_peak_gbps"]
    m["aggregate_store_ceiling_ratio"] = _ratio(m["aggregate_store_gbps"], d2h)
    m["aggregate_load_ceiling_ratio"] = _ratio(m["aggregate_load_gbps"], h2d)
    m["bidir_ceiling_ratio"] = _ratio(m["bidir_gbps"], m["bidir_peak_gbps"])
    m.update(_model_metrics(measured, rows, m["ttft_cold_s"]))
    m.update(_prefetch_metrics(measured))
    assert tuple(m) == METRICS, "metric order drifted from METRICS"
    return m


def _model_metrics(measured: list[RequestRow], rows: list[RequestRow], cold_modeled: Number) -> dict[str, Number]:
    """The real-model metrics (see the module doc); None where no row carries them."""
    m: dict[str, Number] = {}
    for phase in ("cold", "warm"):
        m[f"ttft_{phase}_measured_s"] = _p([r.ttft_measured_s for r in measured
                                            if r.phase == phase and r.ttft_measured_s is not None], 50)
    cold = [v for v in (m["ttft_cold_measured_s"], cold_modeled) if v is not None]
    if m["ttft_cold_measured_s"] is None:
        cold = []  # a simulated run has no measured TTFT to put a ratio on
    m["ttft_speedup_measured"] = _ratio(min(cold) if cold else None, m["ttft_warm_measured_s"])
    # Warm-up rows count too: a wrong continuation is never hidden by calling it warm-up.
    judged = [r for r in rows if r.oracle_pass is not None]
    diffs = [r.logits_max_abs_diff for r in judged if r.logits_max_abs_diff is not None]
    m["logits_max_abs_diff"] = max(diffs) if diffs else None
    m["logits_bitwise_equal"] = all(r.logits_bitwise_equal for r in judged) if judged else None
    m["oracle_pass"] = all(r.oracle_pass for r in judged) if judged else None
    return m


def _prefetch_metrics(measured: list[RequestRow]) -> dict[str, Number]:
    """Warm TTFT and restore time (lookup + load) per tier of a prefetch comparison; None without one."""
    m: dict[str, Number] = {}
    for kind, value in (("ttft_warm", lambda r: r.ttft_s), ("restore", lambda r: r.lookup_s + r.load_s)):
        for t in PREFETCH_TIERS:
            m[f"{kind}_{t}_s"] = _p([value(r) for r in measured if r.phase == "warm" and r.tier == t], 50)
    m["prefetch_ttft_ratio"] = _ratio(m["ttft_warm_l2_prefetch_s"], m["ttft_warm_l1_s"])
    m["prefetch_restore_ratio"] = _ratio(m["restore_l2_prefetch_s"], m["restore_l1_s"])
    m["l2_ttft_ratio"] = _ratio(m["ttft_warm_l2_s"], m["ttft_warm_l1_s"])
    return {k: m[k] for k in PREFETCH_METRICS}
