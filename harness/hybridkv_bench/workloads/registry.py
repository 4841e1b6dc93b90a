"""The workload kinds a scenario's `[[workloads]]` tables may name: kind -> "module:Class", the module imported
when a scenario first names its kind. A new kind is one module beside these (a `WorkloadKind` subclass tagged
with the kind) and one `register_workload` line below.

A scenario's `workloads` field is typed `WorkloadTable` at decoding: msgspec hands each table to `dec_hook`,
which decodes it strictly into its kind's class (`spec.convert` passes the hook)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

import msgspec

from hybridkv_bench.workloads.base import WorkloadTable

if TYPE_CHECKING:
    from hybridkv_bench.workloads.base import WorkloadKind

WORKLOAD_KINDS: dict[str, str] = {}


def register_workload(kind: str, target: str) -> None:
    """Registers workload kind `kind`: `target` is "module:Class" of its WorkloadKind subclass."""
    if kind in WORKLOAD_KINDS:
        raise ValueError(f"workload kind {kind!r} is registered already ({WORKLOAD_KINDS[kind]})")
    WORKLOAD_KINDS[kind] = target


register_workload("long_doc_qa", "hybridkv_bench.workloads.long_doc_qa:LongDocQA")
register_workload("multi_turn", "hybridkv_bench.workloads.multi_turn:MultiTurn")
register_workload("fan_out", "hybridkv_bench.workloads.fan_out:FanOut")
register_workload("divergence", "hybridkv_bench.workloads.divergence:Divergence")
register_workload("l1_pressure", "hybridkv_bench.workloads.l1_pressure:L1Pressure")
register_workload("multi_engine", "hybridkv_bench.workloads.multi_engine:MultiEngine")
register_workload("store_while_load", "hybridkv_bench.workloads.store_while_load:StoreWhileLoad")


def workload_class(kind: str) -> type[WorkloadKind]:
    """The class of workload kind `kind`, its module imported now; ValueError naming the known kinds."""
    try:
        module, _, name = WORKLOAD_KINDS[kind].partition(":")
    except KeyError:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(sorted(WORKLOAD_KINDS))}") from None
    cls = cast("type[WorkloadKind]", getattr(importlib.import_module(module), name))
    if cls.__struct_config__.tag != kind:
        raise TypeError(f"{WORKLOAD_KINDS[kind]} is tagged {cls.__struct_config__.tag!r}, registered as {kind!r}")
    return cls


def decode_workload(table: object) -> WorkloadKind:
    """One `[[workloads]]` table decoded strictly into its kind's class. A bad table raises ValueError in msgspec's
    words, with the path inside the table (msgspec appends the table's own path)."""
    if not isinstance(table, dict):
        raise ValueError(f"Expected `object`, got `{type(table).__name__}`")
    if "kind" not in table:
        raise ValueError("Object missing required field `kind`")
    kind = table["kind"]
    if not isinstance(kind, str) or kind not in WORKLOAD_KINDS:
        raise ValueError(f"Invalid value {kind!r} (known: {', '.join(sorted(WORKLOAD_KINDS))}) - at `$.kind`")
    try:
        return msgspec.convert(table, workload_class(kind))
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None


def dec_hook(type_: type, obj: object) -> object:
    """msgspec's decoding hook for a scenario: a `WorkloadTable` is decoded by its kind's class."""
    if type_ is WorkloadTable:
        return decode_workload(obj)
    raise NotImplementedError(f"no decoder for {type_}")
