"""Each warm request's path from `profile_warm.py`'s marks, in ms: `python analyze.py OUT.json [--csv]`.

Columns (a request through hybridkv; vLLM's own hit has no load step, its lookup answers 0 at once):
- `queue`: from the frontend's submit to the connector's first lookup (the engine core picking the request up);
- `lookup`: `get_num_new_matched_tokens` (hashing the prompt's chunks, one round trip to the server);
- `plan`: the lookup's end to the end of `build_connector_meta` of that step (vLLM allocates, the load is planned);
- `to_worker`: to the worker's `start_load_kv` (the step's hand-off: in its own process, a pickle and a queue);
- `copy`: `start_load_kv` (the copy into vLLM's blocks runs in it on a CPU); `copy_cpu`, `copy_faults`: its thread's
  CPU time and minor page faults in it (runs from `base-ip` on);
- `report`: the copy's end to the scheduler's `update_connector_output` that reports the load finished;
- `resched`: from that report to the start of the step that schedules the request (`build_connector_meta`);
- `load_step`: `plan` + `to_worker` + `copy` + `report` + `resched` minus `copy`: what the extra engine step costs;
- `prep`: that step's `start_load_kv` (the prepares of its stores, before the forward);
- `forward`: the scheduling step's start to the worker's `wait_for_save` (its schedule, hand-off, `prep`, forward);
- `save`: `wait_for_save` (this step's stores);
- `after`: `wait_for_save`'s end to the first token in the frontend (`first_token_latency` from the submit);
- `ttft`: vLLM's `first_token_latency`.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def rows(data: dict) -> list[dict]:
    marks = sorted(data["marks"], key=lambda m: m[0])
    out = []
    for req in data["requests"]:
        # vLLM's engine core names a request by the frontend's id and a suffix of its own
        rid = next(f["rid"] for t, _, name, f in marks if name == "lookup" and req["t0"] <= t <= req["t1"]
                   and f["rid"].split("-")[0] == req["rid"])
        ev: dict[str, list] = defaultdict(list)
        for t, _pid, name, f in marks:
            if not req["t0"] <= t <= req["t1"]:
                continue
            if name == "lookup" and f["rid"] == rid:
                ev["lookup"].append((f["t0"], t))
            elif name == "meta" and rid in f["loads"]:
                ev["meta_load"].append((f["t0"], t))
            elif name == "meta" and rid in f["scheduled"]:
                ev["meta_sched"].append((f["t0"], t))
            elif name == "start_load" and rid in f["loads"]:
                ev["copy"].append((f["t0"], t))
                if "minflt" in f:  # the copy's thread: its page faults and CPU time (later runs record them)
                    ev["copy_cpu"].append((f["cpu"] * 1e3, f["minflt"]))
            elif name == "output" and rid in f["recv"]:
                ev["report"].append((f["t0"], t))
            elif name in ("save", "output", "start_load"):
                ev[name].append((f["t0"], t))
        first_sched = ev["meta_sched"][0]
        save = next(s for s in ev["save"] if s[0] > first_sched[1])
        prep = next(s for s in ev["start_load"] if s[0] > first_sched[1])  # the first step's start_load_kv
        tok = req["t0"] + req["ttft"]
        r = dict(kind=req["kind"], tokens=req["tokens"], repeat=req["repeat"], equal=req["equal"],
                 cached=req["cached"], ttft=req["ttft"] * 1e3,
                 queue=(ev["lookup"][0][0] - req["t0"]) * 1e3,
                 lookup=sum(b - a for a, b in ev["lookup"]) * 1e3,
                 lookups=len(ev["lookup"]))
        if ev["copy"]:
            (_, m1), (c0, c1), (_, p1) = ev["meta_load"][0], ev["copy"][0], ev["report"][0]
            r |= dict(plan=(m1 - ev["lookup"][0][1]) * 1e3, to_worker=(c0 - m1) * 1e3, copy=(c1 - c0) * 1e3,
                      report=(p1 - c1) * 1e3, resched=(first_sched[0] - p1) * 1e3,
                      load_step=(first_sched[0] - ev["lookup"][0][1] - (c1 - c0)) * 1e3,
                      first_step_wait=(first_sched[0] - ev["lookup"][-1][1]) * 1e3)
            if ev["copy_cpu"]:
                r |= dict(copy_cpu=ev["copy_cpu"][0][0], copy_faults=ev["copy_cpu"][0][1])
        else:
            r |= dict(first_step_wait=(first_sched[0] - ev["lookup"][-1][1]) * 1e3)
        r |= dict(prep=(prep[1] - prep[0]) * 1e3, forward=(save[0] - first_sched[0]) * 1e3,
                  save=(save[1] - save[0]) * 1e3, after=(tok - save[1]) * 1e3)
        out.append(r)
    return out


COLS = ["ttft", "queue", "lookup", "lookups", "plan", "to_worker", "copy", "copy_cpu", "copy_faults", "report",
        "resched", "load_step",
        "first_step_wait", "prep", "forward", "save", "after"]


def main() -> None:
    with open(sys.argv[1]) as f:
        data = json.load(f)
    rs = rows(data)
    print("| kind | tokens | rep | equal | " + " | ".join(COLS) + " |")
    print("|---" * (4 + len(COLS)) + "|")
    for r in rs:
        print(f"| {r['kind']} | {r['tokens']} | {r['repeat']} | {r['equal']} | "
              + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in COLS)
              + " |")
    print()
    for n in sorted({r["tokens"] for r in rs}):
        for kind in ("hybridkv", "vllm"):
            sel = [r for r in rs if r["tokens"] == n and r["kind"] == kind]
            med = {c: statistics.median(r[c] for r in sel) for c in COLS if all(c in r for r in sel)}
            print(f"p50 {kind:8s} {n:6d}: " + ", ".join(f"{c} {v:.1f}" for c, v in med.items()))
        w = statistics.median(r["ttft"] for r in rs if r["tokens"] == n and r["kind"] == "hybridkv")
        v = statistics.median(r["ttft"] for r in rs if r["tokens"] == n and r["kind"] == "vllm")
        print(f"ratio p50 {n}: {w / v:.2f}x")


if __name__ == "__main__":
    main()
