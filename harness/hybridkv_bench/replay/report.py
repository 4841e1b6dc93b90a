"""A replay's files beside run.json: replay.csv (one line per request), replay.png (hit share and TTFT per
workload, through hybridkv beside vLLM's own prefix cache) and report.md."""

from __future__ import annotations

import csv
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from hybridkv_bench.replay.rows import Replayed, summary
from hybridkv_bench.replay.spec import ReplayScenario


def _by_workload(rows: list[Replayed]) -> dict[str, list[Replayed]]:
    out: dict[str, list[Replayed]] = {}
    for r in rows:
        out.setdefault(r.workload, []).append(r)
    return out


def _s(x: float | int | None, unit: str = " s", digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{unit}"


def write_outputs(out: Path, sc: ReplayScenario, rows: list[Replayed]) -> None:
    with open(out / "replay.csv", "w", newline="") as f:
        w = csv.DictWriter(f, [x.name for x in fields(Replayed)])
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    groups = {name: summary(rs) for name, rs in _by_workload(rows).items()}
    _plot(out / "replay.png", sc.name, groups)
    lines = [f"# {sc.name}", "",
             "Each request three ways in one run: through hybridkv (an engine whose own prefix cache is dropped "
             "before each request), from vLLM's own prefix cache (an engine with the same history), and "
             "recomputed (the greedy tokens both must equal). Shared: the whole blocks a request shares with what "
             "that engine computed for the earlier requests. TTFT: p50 of the requests that share blocks. Tokens "
             "equal: exactly, every request; a departure: a continuation that is not the recompute's up to where "
             "both part at a near-tie of two tokens (`greedy.departure`), a failure through hybridkv.", "",
             "| workload | requests | hit / shared (hybridkv) | vLLM's own hit / shared | TTFT cold | TTFT via "
             "hybridkv | TTFT from vLLM's cache | hybridkv / vLLM | tokens equal | departures (hybridkv, vLLM's own) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in groups.items():
        lines.append(
            f"| {name} | {m['requests']} | {m['hit_tokens']:,} / {m['shared_tokens']:,} = "
            f"**{_s(m['hit_share'], '', 2)}** | {m['vllm_hit_tokens']:,} / {m['vllm_shared_tokens']:,} = "
            f"{_s(m['vllm_hit_share'], '', 2)} | {_s(m['ttft_cold_s'])} | {_s(m['ttft_warm_s'])} | "
            f"{_s(m['ttft_warm_vllm_s'])} | {_s(m['warm_vs_vllm_ratio'], 'x', 2)} | {bool(m['tokens_equal'])} | "
            f"{m['departures']}, {m['vllm_departures']} |")
    lines += ["", "Every request (tokens; TTFT in seconds):", "",
              "| workload | request | prompt | shared | hit (hybridkv) | shared (vLLM) | vLLM's own hit | TTFT cold | "
              "TTFT hybridkv | TTFT vLLM | tokens equal (hybridkv, vLLM's own) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.request} | {r.prompt_tokens:,} | {r.shared_tokens:,} | {r.hit_tokens:,} | "
                     f"{r.vllm_shared_tokens:,} | {r.vllm_hit_tokens:,} | {r.ttft_cold_s:.3f} | "
                     f"{r.ttft_hybridkv_s:.3f} | {r.ttft_vllm_s:.3f} | {r.tokens_equal}, {r.vllm_tokens_equal} |")
    why = [f"- {r.workload} request {r.request}: {who} {d}" for r in rows
           for who, d in (("through hybridkv", r.departure), ("from vLLM's own cache", r.vllm_departure)) if d]
    if why:
        lines += ["", "Departures from the recompute:", "", *why]
    lines += ["", "![hit share and TTFT](replay.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def _plot(path: Path, title: str, groups: dict[str, dict[str, float | int | None]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(groups)
    x = np.arange(len(names))
    fig, (share, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (key, label) in enumerate([("hit_share", "via hybridkv"), ("vllm_hit_share", "vLLM's own prefix cache")]):
        share.bar(x + (i - 0.5) * 0.35, [groups[n][key] or 0 for n in names], 0.35, label=label)
    share.set_xticks(x, names)
    share.set_ylim(0, 1.25)
    share.set_ylabel("hit tokens / shared whole-block tokens")
    share.legend(loc="upper left", fontsize="small")
    for i, (key, label) in enumerate([("ttft_cold_s", "cold (recompute)"), ("ttft_warm_s", "via hybridkv"),
                                      ("ttft_warm_vllm_s", "vLLM's own prefix cache")]):
        ttft.bar(x + (i - 1) * 0.27, [groups[n][key] or 0 for n in names], 0.27, label=label)
    ttft.set_xticks(x, names)
    ttft.set_ylabel("TTFT p50 (s, vLLM's request metric)")
    ttft.legend(loc="upper left", fontsize="small")
    fig.suptitle(f"{title}: real vLLM engines, each request three ways")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
