"""`report --compare`'s regression rule holds on noise: two runs of one commit flag nothing (the old rule, "every
repeat worse and 5%", called one figure in six a regression with two repeats), and a real 20% slowdown is flagged.
The runs are run folders as `hybridkv bench` writes them, their transfer times jittered per repeat."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import msgspec
import pytest
from benchkit import write_fake_run
from hybridkv.cli import main
from hybridkv_bench.report.compare import compare_figures
from hybridkv_bench.report.regression import ALPHA, MIN_EFFECT, judge, rank_p
from hybridkv_bench.results.folder import load_run
from hybridkv_bench.scenario.spec import expand_matrix


def with_repeats(sf, n: int):
    return dataclasses.replace(sf, scenario=msgspec.structs.replace(sf.scenario, repeats=n))


def verdicts(a: Path, b: Path) -> dict[str, int]:
    figures = compare_figures([load_run(a), load_run(b)])
    out: dict[str, int] = {}
    for f in figures:
        v = f.verdict(1)
        out[v] = out.get(v, 0) + 1
    return out


def test_the_rank_test_is_exact():
    # five against five, all apart: 1 of C(10, 5) = 252 orderings
    assert rank_p([6, 7, 8, 9, 10], [1, 2, 3, 4, 5]) == pytest.approx(1 / 252)
    assert rank_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == 1.0
    # one pair the other way round: 2 orderings of 252
    assert rank_p([5, 7, 8, 9, 10], [1, 2, 3, 4, 6]) == pytest.approx(2 / 252)
    # one value against four: U = its rank among them, each of the 5 places equally likely
    ps = [rank_p([u], [0.5 + k for k in range(4)]) for u in range(5)]
    assert ps == pytest.approx([1, 4 / 5, 3 / 5, 2 / 5, 1 / 5])


def test_the_rule_on_repeats():
    first = [1.00, 1.02, 0.99, 1.01, 1.03]
    assert judge(first[:2], [1.3, 1.4], lower_is_better=True)[0] == "too few repeats"
    assert judge(first, [x * 1.2 for x in first], lower_is_better=True)[0] == "regressed"
    assert judge(first, [x * 1.2 for x in first], lower_is_better=False)[0] == "improved"
    # the whole run 8% slower, apart in every repeat: not beyond 10% once the first run's repeats are moved 10%
    assert judge(first, [x * 1.08 for x in first], lower_is_better=True)[0] == "within noise"
    assert MIN_EFFECT == 0.10 and ALPHA == 0.01
    # 20% on the median, but the repeats overlap: not beyond noise
    assert judge(first, [0.9, 1.2, 1.25, 1.3, 0.95], lower_is_better=True)[0] == "within noise"


@pytest.mark.parametrize("repeats, noise", [(2, 0.05), (2, 0.3), (5, 0.1), (5, 0.3), (8, 0.3)])
def test_two_runs_of_one_commit_flag_nothing(tmp_path: Path, smoke, repeats, noise):
    """Two runs of the same code, each repeat's transfers jittered by up to `noise`, the second run's machine 4%
    slower as a whole: no figure regressed or improved, over several draws."""
    sf = with_repeats(smoke, repeats)
    for seed in range(3):
        a = write_fake_run(tmp_path / f"a{seed}", sf, seed=2 * seed, noise=noise)
        b = write_fake_run(tmp_path / f"b{seed}", sf, seed=2 * seed + 1, noise=noise, drift=0.96)
        v = verdicts(a, b)
        assert v.get("regressed", 0) == 0 and v.get("improved", 0) == 0, v
        if repeats < 5:
            assert set(v) <= {"too few repeats", "n/a"}


@pytest.mark.parametrize("repeats, noise", [(5, 0.05), (8, 0.1)])
def test_a_real_slowdown_is_flagged(tmp_path: Path, smoke, capsys, repeats, noise):
    """Every case's transfers take 20% longer (the rates at 1/1.2), repeats jittered by up to `noise`: every case's
    store and load rates are called regressions, and `report --compare` prints them."""
    sf = with_repeats(smoke, repeats)
    names = {c.name for c in expand_matrix(sf.scenario)}
    a = write_fake_run(tmp_path / "a", sf, seed=0, noise=noise)
    b = write_fake_run(tmp_path / "b", sf, seed=1, noise=noise, rate_scale=dict.fromkeys(names, 1 / 1.2))
    figures = compare_figures([load_run(a), load_run(b)])
    for f in figures:
        if f.metric in ("store_gbps", "load_gbps") and f.values[0]:
            assert f.verdict(1) == "regressed", (f.case, f.metric, f.repeats)
    assert all(f.verdict(1) != "improved" for f in figures)
    assert main(["report", "--compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    n = int(out.split(" figures regressed beyond noise")[0])
    assert n >= 2 * len(names) * len(sf.scenario.workloads), out
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "a rank test (Mann-Whitney, one-sided, exact)" in md and "## Regressions beyond noise" in md


def test_the_old_rule_cried_wolf(smoke):
    """What the old rule did with two repeats: P(both later repeats above both first ones) = 1/6 for any figure."""
    orders = list(itertools.permutations(range(4)))
    worse = sum(1 for o in orders if min(o[2:]) > max(o[:2]))
    assert worse / len(orders) == pytest.approx(1 / 6)
