"""The store / retrieve rule of hybridkv.policy against its statement, pair by pair, for every preset."""

from __future__ import annotations

import pytest
from hybridkv.policy import chunk_objects, resume_bytes, resume_objects
from hybridkv.presets import preset_layout, preset_names


def wanted(kind: str, policy: str, chunk: int, n: int) -> bool:
    """DESIGN's rule for one object: attention always; recurrent state at every chunk under `all`, only at the
    last chunk (n-1) under `boundary`."""
    return kind == "attention" or policy == "all" or chunk == n - 1


@pytest.mark.parametrize("name", preset_names())
@pytest.mark.parametrize("policy", ["boundary", "all"])
def test_chunk_objects_follow_the_rule_chunk_major_in_group_order(name, policy):
    layout = preset_layout(name)
    for first in range(0, 5):
        for n in range(0, 7):
            want = [(c, g) for c in range(first, n) for g, grp in enumerate(layout.groups)
                    if wanted(grp.kind, policy, c, n)]
            assert chunk_objects(layout, policy, first, n) == want, (first, n)


def test_resume_with_every_chunk_held_loads_only_the_boundary_state():
    layout = preset_layout("tiny-hybrid")
    assert resume_objects(layout, "boundary", 3, skip=3) == [(2, g) for g in layout.recurrent_groups]
    assert resume_objects(layout, "boundary", 0, skip=2) == []
    assert resume_objects(layout, "all", 2, skip=1) == [(1, g) for g in range(len(layout.groups))]


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3.6-27b-4layers"])
@pytest.mark.parametrize("policy", ["boundary", "all"])
def test_resume_bytes_is_the_sum_over_resume_objects(name, policy):
    layout = preset_layout(name)
    sizes = [1000 + 7 * g for g in range(len(layout.groups))]  # distinct per group: a wrong group shows
    for n in range(0, 5):
        for skip in range(0, 7):
            want = sum(sizes[g] for _, g in resume_objects(layout, policy, n, skip))
            assert resume_bytes(layout, policy, n, skip, sizes) == want, (n, skip)
