"""The workload kinds a scenario's `[[workloads]]` tables may name, one module each. A new kind is a module
beside these (a `WorkloadKind` subclass with its tag) and one entry in `Workload`."""

from __future__ import annotations

from hybridkv_bench.workloads.divergence import Divergence
from hybridkv_bench.workloads.fan_out import FanOut
from hybridkv_bench.workloads.l1_pressure import L1Pressure
from hybridkv_bench.workloads.long_doc_qa import LongDocQA
from hybridkv_bench.workloads.multi_engine import MultiEngine
from hybridkv_bench.workloads.multi_turn import MultiTurn
from hybridkv_bench.workloads.store_while_load import StoreWhileLoad

# The tagged union msgspec decodes a `[[workloads]]` table into, by its `kind`.
Workload = LongDocQA | MultiTurn | FanOut | Divergence | L1Pressure | MultiEngine | StoreWhileLoad
