"""The median over rounds of each figure in engine_runs.jsonl, old tree beside new, with each side's range.

    python summarize.py engine_runs.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

FIXED = ("lookup_rt", "prepare_rt", "end_session_rt", "store", "store_prepared", "load")


def main(path: str) -> None:
    got: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        side = row["tree"]
        if "lookup71" in row:
            for k in ("lookup71", "lookup1", "lookup1_2threads"):
                got[f"{k} round trip p50"][side].append(row[k]["p50_us"])
        elif "p50_us" in row:
            for k in FIXED:
                got[f"fixed_cost {row['chunks']} chunks {row['commit']}: {k} p50"][side].append(row["p50_us"][k])
    print("| figure (us) | old: median (min-max) | new: median (min-max) | new / old |")
    print("|---|---|---|---|")
    for name, sides in got.items():
        o, n = sides["old"], sides["new"]
        mo, mn = statistics.median(o), statistics.median(n)
        print(f"| {name} | {mo:.0f} ({min(o):.0f}-{max(o):.0f}) | {mn:.0f} ({min(n):.0f}-{max(n):.0f}) "
              f"| {mn / mo:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
