"""Summarize the alternated runs: lookup_p50.py's JSON lines (`old N {...}` / `new N {...}`) and fixed_cost's table
rows after `### old N` / `### new N` headers, as the median over the runs of each side, old beside new.

    python summarize.py lookup.txt fixed_cost.txt
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

STEPS = ("lookup_rt", "load", "store_prepared", "store")


def main(lookup_path: str, fixed_path: str) -> None:
    runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in Path(lookup_path).read_text().splitlines():
        m = re.match(r"(old|new) \d+ (\{.*\})", line)
        if m:
            for k, v in json.loads(m.group(2)).items():
                runs[k][m.group(1)].append(v)
    print("| lookup round trip p50 (us) | main (runs) | h-ops (runs) | median main | median h-ops |")
    print("|---|---|---|---|---|")
    for k, sides in runs.items():
        print(f"| {k} | {sides['old']} | {sides['new']} | {statistics.median(sides['old']):.1f} | "
              f"{statistics.median(sides['new']):.1f} |")
    rows: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    side = ""
    for line in Path(fixed_path).read_text().splitlines():
        if line.startswith("###"):
            side = line.split()[1]
            continue
        m = re.match(r"(.+?) \(p50 us\): (.*)", line)
        if m and side:
            values = dict(re.findall(r"(\S+) (-?\d+)", m.group(2)))
            for step in STEPS:
                rows[(m.group(1), step)][side].append(float(values[step]))
    print()
    print("| fixed_cost row | step | main p50 us (runs) | h-ops p50 us (runs) |")
    print("|---|---|---|---|")
    for (row, step), sides in rows.items():
        print(f"| {row} | {step} | {sides['old']} | {sides['new']} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
