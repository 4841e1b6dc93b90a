from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from benchkit import REPO, write_fake_run
from hybridkv.cli import main


def test_report_command(run_folder: Path, capsys):
    assert main(["report", str(run_folder)]) == 0
    assert (run_folder / "report.md").is_file()
    assert "report.md" in capsys.readouterr().out


def test_report_of_a_non_run_folder_is_a_user_error(tmp_path: Path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"hybridkv report: error: not a run folder: {tmp_path} (no run.json)"


def test_report_of_an_incomplete_run_warns(tmp_path: Path, smoke, capsys):
    folder = write_fake_run(tmp_path / "r", smoke, finish=False, max_cases=1)
    assert main(["report", str(folder)]) == 0
    assert "warning: incomplete run" in capsys.readouterr().out


def test_gate_exit_codes(run_folder: Path, tmp_path: Path, smoke, capsys):
    baseline = tmp_path / "baselines" / "smoke.toml"
    assert main(["gate", str(run_folder), "--write-baseline", str(baseline)]) == 0
    assert main(["gate", str(run_folder), "--write-baseline", str(baseline)]) == 2  # exists, no --force
    assert main(["gate", str(run_folder), "--baseline", str(baseline)]) == 0
    assert "gate: pass" in capsys.readouterr().out

    slow = write_fake_run(tmp_path / "slow", smoke,
                          tamper={"shm-kernel-single-all-all": {"ttft_speedup": 0.5}})
    assert main(["gate", str(slow), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL +long_doc_qa +shm-kernel-single-all-all +ttft_speedup +0.5 +>= ", out)
    assert re.search(r"gate: FAIL \(2 of 316 checks failed\); every check in .*slow/gate.txt", out)
    assert "pass " not in out  # only the failures are printed ...
    assert len((slow / "gate.txt").read_text().splitlines()) == 316 + 4  # ... the whole table is in the run
    assert main(["gate", str(slow), "--baseline", str(baseline), "--verbose"]) == 1
    assert len(capsys.readouterr().out.splitlines()) == 316 + 3

    partial = write_fake_run(tmp_path / "partial", smoke, finish=False, max_cases=4)
    assert main(["gate", str(partial), "--baseline", str(baseline)]) == 1
    assert "incomplete run:" in capsys.readouterr().out
    assert main(["gate", str(partial), "--write-baseline", str(tmp_path / "x.toml")]) == 2
    assert "incomplete run:" in capsys.readouterr().err

    other = tmp_path / "other.toml"
    other.write_text("scenario = 'seed_56k'\n")
    assert main(["gate", str(run_folder), "--baseline", str(other)]) == 2
    assert main(["gate", str(run_folder), "--baseline", str(tmp_path / "missing.toml")]) == 2
    assert main(["gate", str(tmp_path / "nope"), "--baseline", str(baseline)]) == 2


def test_calibrate_command(capsys):
    assert main(["calibrate", "--device", "cpu", "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)
    assert cal["method"] == "cpu-memcpy" and cal["d2h_peak_gbps"] > 0
    assert main(["calibrate", "--device", "cpu"]) == 0
    assert "GB/s" in capsys.readouterr().out


def test_list_command(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "seed_56k" in out and "Qwen3.6-27B TP1, one 55,664-token document" in out
    assert re.search(r"qwen3\.6-27b +1 +4 \(RRRA\) +784 +3,211,264 +205,520,896\n", out)
    # names longer than the usual column keep the columns aligned; one case is "1 case"
    rows = [line for line in out.splitlines() if re.match(r"  \w+ +qwen", line)]
    assert len({len(re.match(r"  \w+ +", line).group(0)) for line in rows}) == 1, rows  # one column start
    assert re.search(r"\n  h200_seed_formats +qwen3\.6-27b tp=1, \d+ cases?: ", out)
    assert re.search(r"\n  l1_pressure +qwen3\.6-27b tp=1, 1 case: ", out)


def test_list_shows_a_broken_scenario(tmp_path: Path, capsys):
    (tmp_path / "bad.toml").write_text("name = 'bad'\n")
    assert main(["list", "--scenarios", str(tmp_path)]) == 0
    assert re.search(r"\n  bad +INVALID: ", capsys.readouterr().out)


@pytest.mark.parametrize("module", ["cli.report", "cli.gate", "cli.list", "cli.calibrate", "report.markdown",
                                    "gate.checks", "results.folder", "scenario.spec", "run.probes",
                                    "results.host"])
def test_light_commands_do_not_import_torch(module: str):
    code = f"import sys, hybridkv_bench.{module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ}, cwd=REPO)


def test_report_compare_shows_both_runs_of_the_same_path_with_deltas(tmp_path: Path, smoke, capsys):
    """Two runs of the same paths (the second with one shm case's transfers at half the rate): every case of
    both is shown, side by side, with its change, and only that case's rates are called regressions. Five
    repeats, so that each run's spread covers its jitter (two repeats' spread often does not)."""
    sf = dataclasses.replace(smoke, scenario=msgspec.structs.replace(smoke.scenario, repeats=5))
    slow = "shm-kernel-single-boundary-all"
    run_folder = write_fake_run(tmp_path / "run", sf)
    other = write_fake_run(tmp_path / "other" / "run", sf, seed=1, rate_scale={slow: 0.5})
    out_dir = tmp_path / "cmp"
    assert main(["report", "--compare", str(run_folder), str(other), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert (out_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"
    md = (out_dir / "compare.md").read_text()
    # both folders are named "run": the labels say whose parent they are
    labels = [f"{run_folder.parent.name}/run", "other/run"]
    assert f"| case | path | figure | {labels[0]} | {labels[1]} | repeat spread | verdict |" in md
    cases = {line.split(" | ")[0][2:] for line in md.splitlines() if line.startswith("| ") and " GB/s |" in line}
    assert slow in cases and "pickle-kernel-single-boundary-all" in cases and len(cases) > 4
    rows = [line for line in md.splitlines() if line.startswith(f"| {slow} | hybridkv shm | load GB/s |")]
    assert len(rows) == len(smoke.scenario.workloads)  # the same case on each workload
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        a, (b, delta) = float(cells[3]), cells[4].split(" ")
        assert 0.45 < float(b) / a < 0.55
        assert re.fullmatch(r"\(-[45]\d\.\d%\)", delta), row
        assert cells[-1] == "regressed"
    # everything else moved by jitter alone: within the repeat spread, never called a regression
    regressed = [line for line in md.splitlines() if line.endswith("| regressed |")]
    assert regressed and all(f"| {slow} |" in line for line in regressed)
    assert all(any(f in line for f in ("GB/s", "/ peak", "TTFT")) for line in regressed)
    assert "figures regressed beyond noise:" in out and f"{slow}: load_gbps" in out
    assert "## Regressions beyond noise" in md
    html = (out_dir / "compare.html").read_text()
    assert '<img src="data:image/png;base64,' in html and "compare.png" not in html.split("<body>")[1]
    assert "<table>" in html and slow in html
    # a run against itself: nothing moved
    assert main(["report", "--compare", str(run_folder), str(run_folder), "--out", str(tmp_path / "same")]) == 0
    assert "0 figures regressed" in capsys.readouterr().out
    assert main(["report", "--compare", str(run_folder), str(other), "--workload", "nope", "--out",
                 str(tmp_path)]) == 2
    assert "no run holds finished cases of workload 'nope'" in capsys.readouterr().err
    assert main(["report", "--compare", str(run_folder), "--out", str(tmp_path)]) == 2
    assert "--compare needs two run folders or more, got 1" in capsys.readouterr().err
    assert main(["report", str(run_folder), "--compare", str(other)]) == 2
    assert main(["report"]) == 2


@pytest.mark.parametrize("keep_header", [False, True])
def test_report_and_gate_of_a_binary_requests_csv_are_one_line_errors(tmp_path: Path, smoke, keep_header, capsys):
    folder = write_fake_run(tmp_path / "run", smoke, max_cases=1)
    baseline = tmp_path / "base.toml"
    assert main(["gate", str(folder), "--write-baseline", str(baseline)]) == 0
    csv = folder / "requests.csv"
    head = csv.read_bytes().split(b"\n")[0] + b"\n" if keep_header else b""
    csv.write_bytes(head + bytes(range(256)) * 64)
    capsys.readouterr()
    for argv in (["report", str(folder)], ["gate", str(folder), "--baseline", str(baseline)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "requests.csv is not" in err, err


def test_a_deeply_nested_scenario_or_baseline_is_a_one_line_error(tmp_path: Path, run_folder: Path, capsys):
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["bench", str(deep), "--out", str(tmp_path / "out")]) == 2  # refused as it loads
    assert main(["gate", str(run_folder), "--baseline", str(deep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all("nested too deeply" in line for line in err), err
