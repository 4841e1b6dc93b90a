"""Each step's per-pass p50s and their median, old against new, from an `ab.sh` run's fixed_cost.jsonl:
    python summary.py RUN/fixed_cost.jsonl"""

from __future__ import annotations

import json
import statistics
import sys

KEYS = ("load.wake", "store_prepared", "store_prepared.to_copy", "store_prepared.issue", "store", "store.issue",
        "load", "load.to_copy", "load.issue", "load_retrieve", "load_retrieve.issue", "lookup_rt")


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for chunks in sorted({r["chunks"] for r in rows}):
        print(f"-- {chunks} chunks (p50 us per pass; old / new)")
        for k in KEYS:
            per = {t: [round(r["p50_us"][k]) for r in rows if r["chunks"] == chunks and r["tree"] == t]
                   for t in ("old", "new")}
            print(f"{k:24s} old {per['old']} med {statistics.median(per['old']):.0f} | "
                  f"new {per['new']} med {statistics.median(per['new']):.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
