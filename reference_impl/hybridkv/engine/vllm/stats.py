"""The connector's counters in vLLM's own KV-connector stats path: per interval, what the scheduler side decided
and the worker side moved, summed over workers by vLLM, logged by its stat logger and counted in its Prometheus
metrics (`vllm:hybridkv_*_total`, one child per engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# name in the payload (and, with vllm:hybridkv_ before and _total after, in Prometheus): what it counts
COUNTERS = {
    "lookups": "lookups the scheduler side sent to the cache server",
    "lookup_failures": "lookups that timed out or failed: misses",
    "hit_tokens_l1": "external hit tokens whose objects were all in the cache server's memory (L1)",
    "hit_tokens_l2": "external hit tokens whose prefix was partly read back from the server's disk (L2)",
    "hit_tokens_unknown": "external hit tokens of a lookup that read L2 itself, if anything (l2_wait_s 0)",
    "loads": "loads that wrote their pages into vLLM's blocks",
    "load_failures": "loads that failed or were given up: vLLM recomputed those requests",
    "loaded_bytes": "bytes loaded into vLLM's blocks",
    "load_seconds": "seconds the loads took, summed (over loads: the mean load latency)",
    "stores": "stores committed to the cache server",
    "store_failures": "stores that failed: later misses, never lost requests",
    "stores_cancelled": "stores not copied within step_timeout_s (a hung server): cancelled, never committed",
    "stores_ordered": "stores (CUDA) whose copies vLLM's stream was made to wait for on the GPU: no step wait",
    "stored_bytes": "bytes stored",
    "store_seconds": "seconds the steps' store copies took, summed",
    "step_loads": "load_mode layerwise: attention loads copied in the step that first scheduled the request",
    "step_loaded_bytes": "load_mode layerwise: bytes of those in-step attention loads",
    "layer_waits": "load_mode layerwise: attention layers that waited for their own pages of in-step loads",
}
# where the scheduler and worker sides' running totals keep them
SCHEDULER_FIELDS = {k: k for k in ("lookups", "lookup_failures", "hit_tokens_l1", "hit_tokens_l2",
                                   "hit_tokens_unknown")}
WORKER_FIELDS = {"loads": "loads", "load_failures": "load_failures", "loaded_bytes": "loaded_bytes",
                 "load_seconds": "load_s", "stores": "stores", "store_failures": "store_failures",
                 "stores_cancelled": "stores_cancelled", "stores_ordered": "stores_ordered",
                 "stored_bytes": "stored_bytes", "store_seconds": "store_s", "step_loads": "step_loads",
                 "step_loaded_bytes": "step_loaded_bytes", "layer_waits": "layer_waits"}


@dataclass(slots=True)
class WorkerStats:
    """What the worker side moved and what it lost (a lost load is recomputed by vLLM)."""

    loads: int = 0
    load_failures: int = 0
    loads_given_up: int = 0  # copies not started lookup_timeout_s after the lookup: reported failed, never written
    loads_pinned: int = 0  # loads of the objects the scheduler's lookup pinned: no lookup of the worker's own
    loaded_bytes: int = 0  # load_mode layerwise: the GDN states of the asynchronous phase only
    stores: int = 0
    store_failures: int = 0
    stores_cancelled: int = 0  # copy not done within step_timeout_s: never committed
    stores_ordered: int = 0  # CUDA: vLLM's stream ordered after the copies, the step never waited for them
    stored_bytes: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    step_loads: int = 0  # load_mode layerwise: attention loads copied in the request's first scheduled step
    step_loaded_bytes: int = 0
    layer_waits: int = 0  # wait_for_layer_load calls that had in-step loads to wait for


@dataclass
class HybridKVStats(KVConnectorStats):
    """One interval's counters (`COUNTERS`), from one side of the connector or summed over several."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.data) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown hybridkv stats {sorted(unknown)}; known: {sorted(COUNTERS)}")
        self.data = {k: self.data.get(k, 0) for k in COUNTERS}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's counters, with mean load and store latencies."""
        out: dict[str, int | float] = dict(self.data)
        for op in ("load", "store"):
            n = self.data[f"{op}s"]
            out[f"{op}_mean_s"] = round(self.data[f"{op}_seconds"] / n, 6) if n else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class IntervalCounter:
    """Turns a side's running totals into the counters of the interval since the last call."""

    def __init__(self, fields: dict[str, str]):
        self.fields = fields
        self.last: dict[str, float] = dict.fromkeys(fields, 0)

    def interval(self, totals: Any) -> HybridKVStats | None:
        """The counters accrued since the last call; None when nothing did."""
        now = {k: getattr(totals, f) for k, f in self.fields.items()}
        delta = {k: now[k] - self.last[k] for k in self.fields}
        self.last = now
        stats = HybridKVStats(data=delta)
        return None if stats.is_empty() else stats


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per `COUNTERS` entry, with vLLM's engine labels."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(self._counter_cls(name=f"vllm:hybridkv_{k}", documentation=doc,
                                                          labelnames=labelnames), per_engine_labelvalues)
            for k, doc in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
