"""When `report --compare` calls a change a regression: a rule that holds on noise.

Two runs of one commit, back to back on a shared CPU machine, differ by more than 5% on many figures, and with two
repeats "every repeat of the later run is worse than every repeat of the first" happens by chance to one figure in
six (2 x 2 / C(4, 2)): of 224 figures, 36 "regressed". So a change is called only when both hold:

- each run has at least MIN_REPEATS measured repeats (fewer: "too few repeats", no verdict);
- a rank test says the repeats moved by more than a slack: Mann-Whitney's one-sided exact p-value at most ALPHA
  for the later repeats against the first run's moved by the slack the bad way (with five repeats a run: at most
  one of the 25 pairs the other way round). The slack is MIN_EFFECT, or where more, half the larger of the figure's
  two repeat spreads ((max - min) / median), or the metric's typical repeat spread across the runs' cases (the
  median; five repeats can be tight by chance, a whole run's cases are not): a minimum effect tested. Two runs of
  one machine drift by a few percent as a whole (another load on the host, another CPU frequency), and of 200
  figures some medians move 10% by chance with tight repeats on both sides: neither passes once the slack is
  granted. The price: a change under 10% is never called, and a noisy figure needs a larger change, or more
  repeats, to be called.

A real 20% slowdown passes; two runs of one commit do not (harness/tests/test_compare_rule.py).
"""

from __future__ import annotations

import statistics
from functools import cache
from typing import Literal

MIN_REPEATS = 5
ALPHA = 0.01
MIN_EFFECT = 0.10

Verdict = Literal["regressed", "improved", "within noise", "too few repeats", "n/a", "baseline"]


@cache
def _arrangements(n: int, m: int) -> tuple[int, ...]:
    """counts[u]: how many of the C(n+m, n) orderings of n and m values have Mann-Whitney U = u (pairs (a, b),
    a from the n, with a > b), without ties."""
    if n == 0 or m == 0:
        return (1,)
    # the largest value belongs to the n (it beats all m: U grows by m) or to the m (nothing added)
    with_n, with_m = _arrangements(n - 1, m), _arrangements(n, m - 1)
    out = [0] * (n * m + 1)
    for u, c in enumerate(with_n):
        out[u + m] += c
    for u, c in enumerate(with_m):
        out[u] += c
    return tuple(out)


def rank_p(above: list[float], below: list[float]) -> float:
    """One-sided exact Mann-Whitney p-value that `above` lies above `below`: P(U >= u) when both come from one
    distribution, u counting the pairs where the `above` value is larger (a tie a half, rounded down: ties make it
    harder, never easier, to call a change)."""
    u = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in above for b in below)
    counts = _arrangements(len(above), len(below))
    return sum(counts[int(u):]) / sum(counts)


def judge(first: list[float], later: list[float], lower_is_better: bool,
          typical_spread: float = 0.0) -> tuple[Verdict, float | None]:
    """(verdict, change of the median) of a figure's repeats in a later run against the first; `typical_spread`:
    the repeat spread this metric has across the runs' cases (five repeats can be tight by chance)."""
    if len(first) < MIN_REPEATS or len(later) < MIN_REPEATS:
        return "too few repeats", None
    a, b = statistics.median(first), statistics.median(later)
    if a <= 0 or min(first) < 0 or min(later) < 0:
        return "n/a", None
    change = (b - a) / a
    own = max((max(r) - min(r)) / statistics.median(r) for r in (first, later)) / 2
    slack = max(MIN_EFFECT, own, typical_spread)
    raised = [x * (1 + slack) for x in first]
    lowered = [x * (1 - slack) for x in first]
    up, down = rank_p(later, raised) <= ALPHA, rank_p(lowered, later) <= ALPHA  # moved beyond the slack
    if up or down:
        return ("regressed" if up == lower_is_better else "improved"), change
    return "within noise", change


def rule_text() -> str:
    """The rule in one paragraph, for compare.md."""
    return (f"A figure *regressed* (or *improved*) when its repeats moved beyond noise: each run has at least "
            f"{MIN_REPEATS} measured repeats, and a rank test (Mann-Whitney, one-sided, exact) of the later run's "
            f"repeats against the first run's moved the bad way by a slack gives p <= {ALPHA:g}: a change beyond the "
            f"slack, tested. The slack: {MIN_EFFECT:.0%}, or where more half the figure's larger repeat spread, or "
            "the metric's typical repeat spread over the runs' cases. Fewer repeats: *too few repeats*, no verdict "
            "(the scenario's "
            f"`repeats = {MIN_REPEATS}`). Two runs of one commit drift by a few percent as a whole; that alone is "
            "never called. Ratios to a ceiling measured once per run are shown, not judged: the repeats cannot show "
            "that one measurement's noise.")
