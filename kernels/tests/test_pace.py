"""Pacing (`hybridkv_kernels.pace`): the duty cycle a pace applies, on any machine; on a GPU, a paced plan copies
every byte and takes the time its pace says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hybridkv_kernels import PagedLayers, available_impls, plan_scatter, run_plan
from hybridkv_kernels.pace import Pace, Pacer, schedule, slices

MB = 1 << 20


@pytest.mark.parametrize("sizes", [[MB] * 40, [3 * MB, 5 * MB, 100, 20 * MB, 7 * MB, 1], [64 * MB], [1]])
def test_slices_cover_every_copy_once_in_order_and_at_least_a_slice_each(sizes) -> None:
    parts = slices(np.array(sizes), 8 * MB)
    assert [i for lo, hi in parts for i in range(lo, hi)] == list(range(len(sizes)))
    assert all(sum(sizes[lo:hi]) >= 8 * MB for lo, hi in parts[:-1])
    # a slice stops at the first copy that fills it
    assert all(sum(sizes[lo:hi - 1]) < 8 * MB for lo, hi in parts)


def test_no_copies_no_slices() -> None:
    assert slices(np.zeros(0, np.int64), MB) == []
    assert schedule(np.zeros(0, np.int64), Pace(0.5, 50.0)) == ([], 0.0)


@pytest.mark.parametrize("fraction", [1.0, 0.8, 0.5, 0.2])
def test_the_duty_cycle_moves_the_fraction_of_the_link(fraction) -> None:
    """Slices at the link's rate and the gaps between them (the one owed after the last included) average the
    pace's fraction of the link."""
    sizes = np.array([400 * 1024] * 300)
    pace = Pace(fraction, 50.0)
    steps, owed = schedule(sizes, pace)
    busy = sizes.sum() / 50e9
    idle = sum(g for g, _, _ in steps) + owed
    assert steps[0][0] == 0.0  # nothing owed: the first slice starts at once
    assert math.isclose(busy / (busy + idle), fraction, rel_tol=1e-9)
    assert len(steps) == math.ceil(sizes.sum() / (8 * MB))


def test_a_transfer_starts_with_what_the_last_one_still_owes() -> None:
    pace = Pace(0.5, 50.0)
    steps, owed = schedule(np.array([MB]), pace, lead_s=0.002)
    assert steps == [(0.002, 0, 1)] and math.isclose(owed, MB / 50e9)
    assert schedule(np.array([MB]), pace, lead_s=-1.0)[0][0][0] == 0.0  # owed long ago: no gap


@pytest.mark.parametrize("bad", [dict(fraction=0.0), dict(fraction=1.5), dict(fraction=float("nan")),
                                 dict(link_gbps=0.0), dict(link_gbps=float("inf")), dict(slice_bytes=0)])
def test_a_bad_pace_is_refused_naming_its_value(bad) -> None:
    args = dict(fraction=0.5, link_gbps=50.0) | bad
    with pytest.raises(ValueError, match=repr(next(iter(bad.values())))):
        Pace(**args)


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["dma", "triton"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_paced_load_writes_every_page_and_takes_its_paced_time(impl, fraction) -> None:
    """64 MiB of 0.4 MB pages scattered into 16 layers at half a pretended 10 GB/s link take at least the time that
    pace says (6.7 ms of copies and as much in gaps, the gap after the last slice aside), and land byte-exact."""
    if impl not in available_impls("cuda"):
        pytest.skip(f"{impl} not available")
    page, layers, blocks = 409_600, 16, 12
    gen = torch.Generator(device="cuda").manual_seed(5)
    tensors = [torch.zeros(2 * blocks, page, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    group = PagedLayers.from_tensors(tensors, page)
    ids = np.random.default_rng(5).permutation(2 * blocks)[:blocks]
    obj = torch.randint(0, 256, (layers * blocks * page,), dtype=torch.uint8, device="cuda", generator=gen).cpu()
    obj = obj.pin_memory()
    plan = plan_scatter([(group, ids, obj)])
    s = torch.cuda.Stream()
    pace = Pace(fraction, 10.0)
    run_plan(plan, impl, s)  # warm-up (a kernel's compile)
    Pacer(s, Pace(0.5, 1000.0)).run(plan, impl)  # the clock's measurement, once
    s.synchronize()
    for t in tensors:
        t.zero_()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(s)
    Pacer(s, pace).run(plan, impl)
    b.record(s)
    b.synchronize()
    took = a.elapsed_time(b) / 1e3
    steps, owed = schedule(np.full(plan.num_pages, page), pace)
    gaps = sum(g for g, _, _ in steps)
    if fraction < 1:
        assert took >= 0.9 * gaps, (took, gaps)
    else:
        assert gaps == 0.0
    got = torch.stack([t[torch.as_tensor(ids, device="cuda")] for t in tensors]).cpu().reshape(-1)
    assert torch.equal(got, obj)
