"""report.md's first screen says which figures are modeled and which measured (with the modeled share of each
headline TTFT), and ttft.png ranks the paths as the headline does: it draws each path's fastest case, where it drew
the median over cases (a path with one fast case and three slow ones ranked first in the table, last in the plot)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchkit import write_fake_run
from hybridkv_bench.report import plots
from hybridkv_bench.report.markdown import write_report
from hybridkv_bench.scenario.spec import expand_matrix

FAST_SHM = "shm-kernel-single-boundary-all"


@pytest.fixture
def run(tmp_path: Path, smoke) -> Path:
    """shm: one case at full rate, its other three at a twentieth; raw: every case at half its rate (a quarter of
    shm's full rate, five times its slow one)."""
    names = [c.name for c in expand_matrix(smoke.scenario)]
    scale = {n: 0.05 for n in names if n.startswith("shm-") and n != FAST_SHM} | {n: 0.5 for n in names
                                                                                  if n.startswith("raw-")}
    return write_fake_run(tmp_path / "run", smoke, rate_scale=scale)


def headline(md: str, workload: str) -> list[tuple[str, float]]:
    """(path label, warm TTFT) of each headline row of `workload`, in the table's order."""
    block = md.split(f"Headline, {workload} ")[1].split("\n\n")[1]
    rows = [line.split("|") for line in block.splitlines()[2:]]  # past the header and its rule
    return [(r[1].strip().split(":")[0], float(r[2])) for r in rows]


def test_the_plot_draws_the_headline_cases(run: Path, smoke, monkeypatch):
    drawn: dict[str, dict[str, list[float]]] = {}
    save = plots._save

    def capture(plt, fig, path):
        if path.name == "ttft.png":
            for ax in fig.axes:
                wl = ax.get_title().split(":")[0]
                labels = [t.get_text() for t in ax.get_xticklabels()]
                warm = next(c for c in ax.containers if c.get_label().startswith("warm"))
                drawn[wl] = dict(zip(labels, [[float(v)] for v in warm.datavalues], strict=True))
        return save(plt, fig, path)

    monkeypatch.setattr(plots, "_save", capture)
    write_report(run)
    md = (run / "report.md").read_text()
    for wl in (w.label for w in smoke.scenario.workloads):
        table = headline(md, wl)
        assert [p for p, _ in sorted(table, key=lambda r: r[1])][:2] == ["hybridkv shm", "raw frames"], table
        plotted = drawn[wl]
        for path, warm in table:
            assert plotted[path][0] == pytest.approx(warm, rel=2e-3), (path, plotted, table)  # the table rounds
        # the median over cases, which the plot drew before, ranks them the other way round here
        import pandas as pd
        from hybridkv_bench.report.markdown import case_table
        from hybridkv_bench.results.folder import load_run

        df, _ = case_table(load_run(run))
        med = df[df.workload == wl].groupby("wire_format").ttft_warm_s.median()
        assert med["raw"] < med["shm"]
        assert isinstance(med, pd.Series)


def test_the_first_screen_says_what_is_modeled(run: Path):
    write_report(run)
    md = (run / "report.md").read_text()
    first = md.split("## Run")[0]
    assert "**Modeled:** prefill time" in first and "**Measured:** lookup, load, store" in first
    assert "of cold TTFT and" in first and "of warm TTFT** over the cases" in first
    assert "Paths compared: hybridkv shm, raw frames, pickle (seed)" in first and "no other cache system ran" in first
    assert "| TTFT modeled cold / warm |" in first
    row = next(line for line in first.splitlines() if line.startswith(f"| hybridkv shm: {FAST_SHM}"))
    cold, warm = row.rstrip(" |").rsplit("|", 1)[1].strip().split(" / ")
    assert cold.endswith("%") and warm.endswith("%") and int(cold[:-1]) >= int(warm[:-1])
