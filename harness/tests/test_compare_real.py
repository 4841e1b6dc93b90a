"""`report --compare`'s rule on real runs (issue 39): two runs of scenarios/compare_cpu.toml on one commit flag
nothing, and a run with a planted 20% slowdown (`bench --planted-slowdown 0.25`: every timed store and load waits a
quarter of its own time more, the rates at 1/1.25) is called a regression wherever the runs' own repeat spreads let
a 20% change be told from noise. test_compare_rule.py holds the rule to synthetic repeats; these are the runner's."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchkit import SCENARIOS
from hybridkv.cli import main
from hybridkv_bench.report.compare import Figure, compare_figures
from hybridkv_bench.report.regression import MIN_EFFECT, MIN_REPEATS
from hybridkv_bench.results.folder import load_run

PLANTED = 0.25
TRANSFERS = ("store_gbps", "load_gbps")
# A 20% slowdown is beyond the rule's slack only where the repeats are tight: the slack is MIN_EFFECT, or half the
# larger repeat spread (or the metric's typical one) where more, and 20% must clear it with the repeats' own scatter
# and the drift between two runs on top: with spreads up to MIN_EFFECT that leaves 10% for them. Past it the rule may
# rightly say "within noise" (a CPU shared by many jobs: spreads of 40-240% at load 12-40).
RESOLVABLE_SPREAD = MIN_EFFECT


def bench(out: Path, *extra: str) -> Path:
    assert main(["bench", str(SCENARIOS / "compare_cpu.toml"), "--out", str(out), "--no-report", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Three real runs, one after another: a, b (the same commit) and one with the planted slowdown."""
    d = tmp_path_factory.mktemp("compare")
    return {"a": bench(d / "a"), "b": bench(d / "b"), "slow": bench(d / "slow", "--planted-slowdown", str(PLANTED))}


def figures(first: Path, later: Path) -> list[Figure]:
    return [f for f in compare_figures([load_run(first), load_run(later)]) if f.verdict(1) != "n/a"]


@pytest.mark.slow  # three real runs of about 50 s each on 2 busy cores
def test_two_runs_of_one_commit_flag_nothing(runs, tmp_path, capsys):
    found = figures(runs["a"], runs["b"])
    assert {f.metric for f in found} >= {*TRANSFERS, "ttft_warm_s", "lookup_s"}
    assert all(len(r) >= MIN_REPEATS for f in found for r in f.repeats)  # judged, not "too few repeats"
    called = [(f.case, f.metric, f.verdict(1), f.repeats) for f in found if f.verdict(1) != "within noise"]
    assert not called
    assert main(["report", "--compare", str(runs["a"]), str(runs["b"]), "--out", str(tmp_path / "cmp")]) == 0
    assert capsys.readouterr().out.startswith("0 figures regressed beyond noise\n")


@pytest.mark.slow
def test_the_planted_slowdown_is_real(runs):
    """Each timed transfer of the planted run lasted at least 1.25 times its copies (the knob acts inside the
    timing), and run.json and the report say the run was slowed on purpose."""
    run = load_run(runs["slow"])
    assert run.record.context["planted_slowdown"] == PLANTED
    rows = [r for c in run.cases for r in run.rows_of(c)]
    assert all(r.store_s >= (1 + PLANTED) * r.store_copy_s * 0.999 for r in rows if r.bytes_stored)
    assert all(r.load_s >= (1 + PLANTED) * r.load_copy_s * 0.999 for r in rows if r.bytes_loaded)
    assert "planted_slowdown" not in load_run(runs["a"]).record.context


@pytest.mark.slow
def test_a_planted_slowdown_is_flagged_where_noise_allows(runs, tmp_path, capsys):
    found = figures(runs["a"], runs["slow"])
    assert not [f for f in found if f.verdict(1) == "improved"]
    transfers = [f for f in found if f.metric in TRANSFERS]
    assert transfers
    tight = [f for f in transfers if max(s for s in f.spreads if s is not None) <= RESOLVABLE_SPREAD
             and max(f.typical, default=0.0) <= RESOLVABLE_SPREAD]
    missed = [(f.case, f.metric, f.repeats) for f in tight if f.verdict(1) != "regressed"]
    assert not missed
    assert main(["report", "--compare", str(runs["a"]), str(runs["slow"]), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert int(out.split(" figures regressed beyond noise")[0]) >= len(tight)
    assert "planted slowdown 0.25" in (tmp_path / "cmp" / "compare.md").read_text()
    if not tight:
        spreads = {f"{f.case}/{f.metric}": [f"{s:.0%}" for s in f.spreads if s is not None] for f in transfers}
        pytest.skip(f"every transfer figure's repeats spread beyond {RESOLVABLE_SPREAD:.0%} on this machine now "
                    f"({spreads}): a 20% change may be within its noise there, so its call is not asserted")


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan"])
def test_a_planted_slowdown_outside_0_to_1_is_one_line(value, tmp_path, capsys):
    assert main(["bench", str(SCENARIOS / "compare_cpu.toml"), "--out", str(tmp_path / "r"),
                 "--planted-slowdown", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv bench: error: a planted slowdown is a fraction in 0..1") and err.count("\n") == 1
    assert not (tmp_path / "r").exists()
