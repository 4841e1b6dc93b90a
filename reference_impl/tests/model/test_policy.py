"""The store / retrieve rule of hybridkv.model.policy against its statement, pair by pair, for every preset."""

from __future__ import annotations

import pytest
from hybridkv.model.policy import chunk_objects, resume_bytes, resume_objects, resume_slices
from hybridkv.model.presets import preset_layout, preset_names


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


def sliding_layout(window: int, block: int = 16):
    """gpt-oss's grouping at a small size: a sliding-window group, a full-attention group, and a GDN group."""
    from hybridkv.model.layout import GroupLayout, ModelLayout

    return ModelLayout(model="m", groups=(
        GroupLayout(kind="sliding", layer_names=("model.layers.0",), page_bytes=256, block_tokens=block,
                    window=window),
        GroupLayout(kind="attention", layer_names=("model.layers.1",), page_bytes=256, block_tokens=block),
        GroupLayout(kind="recurrent", layer_names=("model.layers.2",), page_bytes=256, block_tokens=block)))


@pytest.mark.parametrize("policy", ["boundary", "all"])
@pytest.mark.parametrize("window,chunk", [(40, 16), (40, 32), (100, 32), (20, 64), (1000, 16)])
def test_a_sliding_group_stores_every_chunk_and_resumes_from_its_window(policy, window, chunk):
    layout = sliding_layout(window)
    g = layout.groups[0]
    for first in range(0, 4):
        for n in range(0, 9):
            stored = chunk_objects(layout, policy, first, n)
            assert [c for c, grp in stored if grp == 0] == list(range(first, n))  # a store writes every chunk's
            for skip in range(0, 10):
                got = resume_objects(layout, policy, n, skip, chunk)
                start = g.window_start_chunk(n, chunk)
                want = [(c, gg) for c in range(min(skip, n), n) for gg in range(3)
                        if gg == 1 or (gg == 0 and c >= start) or (gg == 2 and (policy == "all" or c == n - 1))]
                want += [(n - 1, 2)] if n and skip >= n else []
                assert got == want, (first, n, skip)
                sizes = [1000, 3000, 7000]
                assert resume_bytes(layout, policy, n, skip, sizes, chunk) == sum(sizes[gg] for _, gg in got)


@pytest.mark.parametrize("policy", ["boundary", "all"])
@pytest.mark.parametrize("window,chunk", [(40, 16), (100, 32), (1000, 16)])
def test_resume_slices_joined_are_resume_objects(policy, window, chunk):
    """A large lookup pins its objects a piece at a time: the pieces, whole chunks each and as few as the piece size
    allows, joined are resume_objects' list."""
    for layout in (sliding_layout(window), preset_layout("tiny-hybrid")):
        for n in (0, 1, 2, 7, 30):
            for skip in (0, 1, 5, 30, 31):
                want = resume_objects(layout, policy, n, skip, chunk)
                for size in (1, 2, 3, 5, 64):
                    pieces = list(resume_slices(layout, policy, n, skip, chunk, size))
                    assert [o for p in pieces for o in p] == want, (n, skip, size)
                    per = max(1, size // len(layout.groups))
                    assert len(pieces) == -(-max(0, n - min(skip, n)) // per) + (1 if n and skip >= n else 0)


def test_a_layout_with_sliding_groups_needs_the_chunk_size_to_resume():
    layout = sliding_layout(40)
    # a 40-token window resumed at 8 chunks of 16 tokens reads tokens 89.. : chunks 5, 6, 7
    assert resume_objects(layout, "boundary", 8, 0, 16)[-7:] == [(5, 0), (5, 1), (6, 0), (6, 1), (7, 0), (7, 1),
                                                                  (7, 2)]
    with pytest.raises(ValueError, match="needs chunk_tokens"):
        resume_objects(layout, "boundary", 3)
