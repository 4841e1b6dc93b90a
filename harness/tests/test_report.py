from __future__ import annotations

from pathlib import Path

import pytest
from benchkit import write_fake_run
from hybridkv_bench.gate.write import baseline_from_run
from hybridkv_bench.report.markdown import case_table, write_report
from hybridkv_bench.report.tables import markdown_table
from hybridkv_bench.results.folder import NotARunFolder, load_run

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_writes_markdown_and_figures(run_folder: Path):
    paths = write_report(run_folder)
    names = sorted(p.name for p in paths)
    assert names == ["policies.png", "report.html", "report.md", "server.png", "throughput.png", "ttft.png"]
    for p in paths:
        assert p.parent == run_folder and p.stat().st_size > 1000
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG
    md = (run_folder / "report.md").read_text()
    assert md.startswith("# hybridkv run: smoke\n") and "INCOMPLETE" not in md
    assert "prefill of the whole prompt (**modeled**)" in md and "load of the hit (measured)" in md
    assert "5000.0 uncached tokens per second" in md
    assert "| shm-kernel-single-boundary-all |" in md and "### long_doc_qa" in md and "### fan_out" in md
    assert "## Calibration" in md and "cpu-memcpy" in md and "## Context" in md
    assert "Every request-derived metric in run.json matches" in md
    assert "## Failed cases\n\nNone." in md
    for fig in ("ttft.png", "throughput.png", "server.png", "policies.png"):
        assert f"]({fig})" in md


def test_report_html_is_one_file_with_its_pictures_inline(run_folder: Path):
    import base64
    import re

    write_report(run_folder)
    page = (run_folder / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "<title>hybridkv run: smoke</title>" in page
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) == 4  # the four figures of report.md, none pointing at a file or the network
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    inlined = {base64.b64decode(s.split(",", 1)[1]) for s in sources}
    assert inlined == {(run_folder / f).read_bytes() for f in ("ttft.png", "throughput.png", "server.png",
                                                              "policies.png")}
    assert "<table>" in page and "| shm-" not in page  # tables rendered, not left as Markdown
    assert "http://" not in page and "https://" not in page


def test_report_recomputes_from_the_csv_and_flags_run_json_that_disagrees(tmp_path: Path, smoke):
    folder = write_fake_run(tmp_path / "r", smoke, tamper={"shm-dma-single-all-all": {"load_gbps": 999.0}})
    df, findings = case_table(load_run(folder))
    assert len(findings) == 2  # one per workload
    assert all("run.json load_gbps = 999" in f and "requests.csv gives" in f for f in findings)
    shown = df[df.case == "shm-dma-single-all-all"].load_gbps
    assert (shown < 999).all(), "the report must show the CSV's figure, not the tampered one"
    write_report(folder, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Integrity" in md and "run.json load_gbps = 999" in md
    assert not (folder / "report.md").exists()


def test_report_marks_an_incomplete_run_and_lists_failures(tmp_path: Path, smoke):
    folder = write_fake_run(tmp_path / "r", smoke, finish=False, max_cases=5,
                            fail={"raw-kernel-single-boundary-all"})
    write_report(folder)
    md = (folder / "report.md").read_text()
    assert md.splitlines()[2].startswith("> **INCOMPLETE RUN.** 5 of 32 case results written")
    assert "| long_doc_qa | raw-kernel-single-boundary-all | server went away |" in md


def test_report_of_a_corrupting_run_says_so(tmp_path: Path, smoke):
    folder = write_fake_run(tmp_path / "r", smoke, max_cases=2)
    csv_path = folder / "requests.csv"
    lines = csv_path.read_text().splitlines()
    cells = lines[-1].split(",")
    cells[-1] = "3"
    csv_path.write_text("\n".join([*lines[:-1], ",".join(cells)]) + "\n")
    write_report(folder)
    md = (folder / "report.md").read_text()
    assert "## CORRUPT CHUNKS" in md and "corrupt_chunks = 0, requests.csv gives 3" in md


def test_report_of_a_non_run_folder_fails(tmp_path: Path):
    with pytest.raises(NotARunFolder):
        write_report(tmp_path)


def test_markdown_table():
    t = markdown_table(["a", "b|c", "n"], [["x|y", None, 1234567], ["z", True, 0.000123456]], "lcr")
    assert t.splitlines() == [
        "| a | b\\|c | n |",
        "|:---|:---:|---:|",
        "| x\\|y | n/a | 1,234,567 |",
        "| z | yes | 0.0001235 |",
    ]
    with pytest.raises(ValueError, match="row has 1 cells"):
        markdown_table(["a", "b"], [["x"]])


def test_report_opens_with_the_verdict_and_keeps_tables_narrow(run_folder: Path, tmp_path: Path):
    baseline = tmp_path / "b.toml"
    baseline.write_text(baseline_from_run(load_run(run_folder)))
    write_report(run_folder, baseline=baseline)
    md = (run_folder / "report.md").read_text()
    first = md.split("\n## ")[1]
    assert first.startswith("Verdict\n") and f"**gate: pass (0 of 316 checks failed)**, against `{baseline}`" in first
    assert "**Modeled:** prefill time (5000.0 uncached tokens/s)" in first and "No GPU in this run" in first
    assert "| hybridkv shm: shm-" in first and "of ceiling)" in first  # headline figures beside their ceilings
    widths = [line.count("|") - 1 for line in md.splitlines() if line.startswith("|")]
    assert widths and max(widths) < 19
    write_report(run_folder)  # no baseline: the invariants alone, and it says so
    assert "invariants only" in (run_folder / "report.md").read_text().split("\n## ")[1]


def test_plots_choose_log_axes_and_readable_units():
    from hybridkv_bench.report import plots

    plt = plots._pyplot()
    fig, ax = plt.subplots()
    assert plots.log_if_wide(ax, [7.68, 0.13]) and ax.get_yscale() == "log"
    fig2, ax2 = plt.subplots()
    assert not plots.log_if_wide(ax2, [0.132, 0.02, None, float("nan")]) and ax2.get_yscale() == "linear"
    plt.close(fig)
    plt.close(fig2)
    assert plots.byte_unit(2_290_000) == (1e6, "MB") and plots.byte_unit(512) == (1.0, "B")
    cpu = plots.Setting.of({"method": "cpu-memcpy", "device": "cpu", "d2h_peak_gbps": 2.8})
    gpu = plots.Setting.of({"method": "cuda-pinned-events", "device": "NVIDIA H200"})
    assert "GPU" not in cpu.store_path.replace("no GPU", "") and "GPU -> server arena" in gpu.store_path
