"""Every implementation moves exactly the planned pages: each byte checked against the raw-offset oracle."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest
import torch
from hybridkv_kernels import HOLE, available_impls, gather_pages, plan_gather, plan_scatter, run_plan
from kernel_pools import POOLS, SENTINEL, assert_guards, guarded, qwen_like_groups, random_bytes

IDS = [7, 0, 3, 8, 1]  # odd and unsorted, first and a late block


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_gather_matches_oracle(pool_name, cpu_impl, gen):
    pool = POOLS[pool_name](gen)
    layers = pool.layers()
    buf, obj = guarded(layers.object_bytes(len(IDS)))
    before = pool.raw.clone()
    gather_pages([(layers, IDS, obj)], engine=cpu_impl)
    np.testing.assert_array_equal(obj.numpy(), pool.expected_object(IDS))
    assert_guards(buf, 64)
    assert torch.equal(pool.raw, before), "a gather wrote to the engine pages"


@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_scatter_writes_only_target_pages(pool_name, cpu_impl, gen):
    pool = POOLS[pool_name](gen)
    layers = pool.layers()
    payload = random_bytes((layers.object_bytes(len(IDS)),), gen)
    expected = pool.raw.clone().reshape(-1).numpy()
    src = payload.numpy().reshape(pool.num_layers, len(IDS), pool.page_bytes)
    for layer in range(pool.num_layers):
        for j, b in enumerate(IDS):
            o = pool.offset(layer, b)
            expected[o : o + pool.page_bytes] = src[layer, j]
    run_plan(plan_scatter([(layers, IDS, payload)]), cpu_impl)
    # The whole raw buffer: target pages hold the payload, every gap and other page is unchanged.
    np.testing.assert_array_equal(pool.raw.reshape(-1).numpy(), expected)


@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_scatter_leaves_the_pages_of_holes_unwritten(pool_name, cpu_impl, gen):
    pool = POOLS[pool_name](gen)
    layers = pool.layers()
    ids = [HOLE, 7, HOLE, 3, 8]  # a sliding window's chunk: blocks outside the window the engine freed
    payload = random_bytes((layers.object_bytes(len(ids)),), gen)
    expected = pool.raw.clone().reshape(-1).numpy()
    src = payload.numpy().reshape(pool.num_layers, len(ids), pool.page_bytes)
    for layer in range(pool.num_layers):
        for j, b in enumerate(ids):
            if b != HOLE:
                o = pool.offset(layer, b)
                expected[o : o + pool.page_bytes] = src[layer, j]
    run_plan(plan_scatter([(layers, ids, payload)]), cpu_impl)
    np.testing.assert_array_equal(pool.raw.reshape(-1).numpy(), expected)


def test_narrow_alignment_still_copies(cpu_impl, gen):
    pool = POOLS["padded_fp8"](gen)
    layers = pool.layers()
    buf, obj = guarded(layers.object_bytes(len(IDS)), guard=5)  # 5-byte guard: only 1-byte accesses fit
    plan = plan_gather([(layers, IDS, obj)])
    assert plan.elem_bytes == 1
    run_plan(plan, cpu_impl)
    np.testing.assert_array_equal(obj.numpy(), pool.expected_object(IDS))
    assert_guards(buf, 5)


def test_sixteen_byte_alignment_detected(gen):
    pool = POOLS["padded_fp8"](gen)
    layers = pool.layers()
    buf, obj = guarded(layers.object_bytes(2), guard=64)
    assert plan_gather([(layers, [1, 2], obj)]).elem_bytes == 16


def _qwen_transfers(groups, chunk_ids, device="cpu"):
    """(layers, ids, object) per (chunk, group): attention 2 blocks per chunk, recurrent 1 state block."""
    transfers, objs = [], []
    for g, pool in enumerate(groups):
        layers = pool.layers()
        for ids in chunk_ids[g]:
            buf, obj = guarded(layers.object_bytes(len(ids)), device=device)
            transfers.append((layers, ids, obj))
            objs.append((pool, ids, buf, obj))
    return transfers, objs


# Disjoint blocks per group out of one shared pool of 24, as vLLM's block pool hands them out.
QWEN_IDS = [
    [[5, 17], [2, 9], [23, 0]],  # attention: 3 chunks x 2 blocks
    [[11], [4]],
    [[19], [7]],
    [[13], [1]],
]


def test_multi_group_plan_one_launch_round_trip(cpu_impl, gen):
    groups = qwen_like_groups(gen)
    transfers, objs = _qwen_transfers(groups, QWEN_IDS)
    plan = plan_gather(transfers)
    assert plan.num_pages == 4 * (6 + 2 + 2 + 2)
    run_plan(plan, cpu_impl)
    for pool, ids, buf, obj in objs:
        np.testing.assert_array_equal(obj.numpy(), pool.expected_object(ids))
        assert_guards(buf, 64)

    # Scatter into a fresh pool at other blocks, then every page read back equals the original.
    fresh = qwen_like_groups(torch.Generator().manual_seed(99))
    remap = {b: (b * 5 + 3) % 24 for b in range(24)}  # a permutation, so targets stay disjoint
    back = [(f.layers(), [remap[b] for b in ids], obj) for f, (_, ids, _, obj) in
            zip([fresh[i] for i, g in enumerate(QWEN_IDS) for _ in g], objs, strict=True)]
    run_plan(plan_scatter(back), cpu_impl)
    for pool, ids, _, _ in objs:
        for layer in range(pool.num_layers):
            for b in ids:
                np.testing.assert_array_equal(fresh[0].page(layer, remap[b]), pool.page(layer, b))


def test_triton_partial_last_block_of_page(gen):
    if "triton" not in available_impls("cpu"):
        pytest.skip("Triton interpreter not enabled")
    from hybridkv_kernels.copy_triton import copy_pages_triton, launch_config

    pool = POOLS["dense_bf16"](gen)  # 222-byte pages = 111 two-byte elements
    layers = pool.layers()
    buf, obj = guarded(layers.object_bytes(len(IDS)))
    plan = plan_gather([(layers, IDS, obj)])
    block, parts = launch_config(111, 2, 64)
    assert (block, parts) == (32, 4) and 111 % block
    copy_pages_triton(plan, block_bytes=64)
    np.testing.assert_array_equal(obj.numpy(), pool.expected_object(IDS))
    assert_guards(buf, 64)


def test_shm_mmap_object_round_trip(cpu_impl, gen):
    pool = POOLS["shared_fp32"](gen)
    layers = pool.layers()
    size = layers.object_bytes(len(IDS))
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=where, prefix="hkv-kernels-") as f:
        f.truncate(size + 4096)
        mm = mmap.mmap(f.fileno(), size + 4096)
        try:
            arena = torch.frombuffer(mm, dtype=torch.uint8)
            arena.fill_(SENTINEL)
            obj = arena[4096 - 256 : 4096 - 256 + size]  # an arena slot that is not page-aligned
            gather_pages([(layers, IDS, obj)], engine=cpu_impl)
            # Another mapping of the file (the server's view) sees the gathered bytes.
            with open(f.name, "rb") as again:
                seen = np.frombuffer(again.read(), dtype=np.uint8)
            np.testing.assert_array_equal(seen[3840 : 3840 + size], pool.expected_object(IDS))
            assert (seen[:3840] == SENTINEL).all() and (seen[3840 + size :] == SENTINEL).all()

            target = POOLS["shared_fp32"](torch.Generator().manual_seed(7))
            run_plan(plan_scatter([(target.layers(), IDS, obj)]), cpu_impl)
            for layer in range(pool.num_layers):
                for b in IDS:
                    np.testing.assert_array_equal(target.page(layer, b), pool.page(layer, b))
            del arena, obj
        finally:
            mm.close()


@pytest.mark.parametrize("first", [0, 1, 16, 40])
@pytest.mark.parametrize("n", [1, 2, 31, 32, 80, 255, 592, 2400])
def test_driver_call_slices_cover_every_run_once_in_order(monkeypatch, n, first):
    """The batched calls' slices: every run once, in order; a first slice of FIRST_SLICE_RUNS where the plan has at
    least twice as many runs, each next one SLICE_GROWTH times larger, none over the cap."""
    from hybridkv_kernels import copy_dma

    monkeypatch.setattr(copy_dma, "FIRST_SLICE_RUNS", first)
    cap = 512
    bounds = copy_dma.slices(n, cap)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [hi - lo for lo, hi in bounds]
    assert all(0 < s <= cap for s in sizes)
    if first and n >= 2 * first:
        assert sizes[0] == first
        assert all(b == min(cap, a * copy_dma.SLICE_GROWTH) for a, b in zip(sizes, sizes[1:-1], strict=False))
    else:
        assert sizes == [min(cap, n - lo) for lo, _ in bounds]
