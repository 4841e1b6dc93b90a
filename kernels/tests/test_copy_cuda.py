"""The same byte-exact cases on a GPU, with objects in device memory, pinned memory and a registered
shared-memory mapping (the cache server's arena as an engine maps it). Skipped without CUDA."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading

import numpy as np
import pytest
import torch
from hybridkv_kernels import HOLE, PagedLayers, available_impls, cuda_batch, plan_gather, plan_scatter, run_plan
from hybridkv_kernels.copy_dma import SLICE_RUNS, copy_pages_dma
from kernel_pools import POOLS, SENTINEL, assert_guards, guarded, qwen_like_groups, random_bytes

pytestmark = pytest.mark.cuda
IDS = [7, 0, 3, 8, 1]
GUARD = 64


@pytest.fixture(params=["torch", "triton", "dma", "dma-loop"])
def gpu_impl(request) -> str:
    """An implementation; `dma` is the batched driver call where the driver has it, `dma-loop` one copy per run."""
    if request.param.split("-")[0] not in available_impls("cuda"):
        pytest.skip(f"{request.param} not available on CUDA")
    return request.param


def _run(plan, impl: str, stream: torch.cuda.Stream | None = None) -> None:
    if impl != "dma-loop":
        run_plan(plan, impl, stream)
        return
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        copy_pages_dma(plan, batched=False)


@pytest.fixture
def shm_arena():
    """A /dev/shm file mapped here and page-locked with cudaHostRegister, as a uint8 tensor."""
    size = 1 << 20
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(size)
        mm = mmap.mmap(f.fileno(), size)
        arena = torch.frombuffer(mm, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(arena.data_ptr(), size, 0)) == 0
        try:
            assert arena.is_pinned(), "registered memory must count as page-locked"
            yield arena
        finally:
            torch.cuda.synchronize()
            cudart.cudaHostUnregister(arena.data_ptr())
            del arena
            mm.close()


def _object_buffer(place: str, nbytes: int, shm_arena) -> tuple[torch.Tensor, torch.Tensor]:
    """A sentinel-filled buffer with guards in device, pinned or registered-shm memory, and its object."""
    if place == "shm":
        buf = shm_arena[4096 - GUARD : 4096 + nbytes + GUARD]
        buf.fill_(SENTINEL)
        return buf, buf[GUARD : GUARD + nbytes]
    return guarded(nbytes, GUARD, device="cuda" if place == "device" else "cpu", pin=place == "pinned")


@pytest.mark.parametrize("place", ["device", "pinned", "shm"])
@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_gather_and_scatter_on_gpu(pool_name, place, gpu_impl, shm_arena):
    gen = torch.Generator().manual_seed(5)
    pool = POOLS[pool_name](gen, device="cuda")
    layers = pool.layers()
    buf, obj = _object_buffer(place, layers.object_bytes(len(IDS)), shm_arena)
    _run(plan_gather([(layers, IDS, obj)]), gpu_impl)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(obj.cpu().numpy(), pool.expected_object(IDS))
    assert_guards(buf, GUARD)

    target = POOLS[pool_name](torch.Generator().manual_seed(6), device="cuda")
    expected = target.raw.reshape(-1).cpu().numpy().copy()
    src = obj.cpu().numpy().reshape(pool.num_layers, len(IDS), pool.page_bytes)
    for layer in range(pool.num_layers):
        for j, b in enumerate(IDS):
            o = target.offset(layer, b)
            expected[o : o + pool.page_bytes] = src[layer, j]
    _run(plan_scatter([(target.layers(), IDS, obj)]), gpu_impl)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(target.raw.reshape(-1).cpu().numpy(), expected)


@pytest.mark.parametrize("place", ["device", "pinned", "shm"])
def test_scatter_with_holes_on_gpu(place, gpu_impl, shm_arena):
    """A sliding-window load: the object's pages at holes are written nowhere, the others where they belong."""
    gen = torch.Generator().manual_seed(9)
    pool = POOLS["dense_bf16"](gen, device="cuda")
    ids = [HOLE, 7, HOLE, 3, 8]
    buf, obj = _object_buffer(place, pool.layers().object_bytes(len(ids)), shm_arena)
    obj.copy_(random_bytes((obj.numel(),), gen).to(obj.device))
    expected = pool.raw.reshape(-1).cpu().numpy().copy()
    src = obj.cpu().numpy().reshape(pool.num_layers, len(ids), pool.page_bytes)
    for layer in range(pool.num_layers):
        for j, b in enumerate(ids):
            if b != HOLE:
                o = pool.offset(layer, b)
                expected[o : o + pool.page_bytes] = src[layer, j]
    _run(plan_scatter([(pool.layers(), ids, obj)]), gpu_impl)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(pool.raw.reshape(-1).cpu().numpy(), expected)


@pytest.mark.parametrize("place", ["device", "pinned", "shm"])
def test_multi_group_on_a_side_stream(place, gpu_impl, shm_arena):
    gen = torch.Generator().manual_seed(8)
    groups = qwen_like_groups(gen, device="cuda")
    ids = [[5, 17], [11], [19], [13]]
    transfers, bufs, offset = [], [], 0
    for pool, blocks in zip(groups, ids, strict=True):
        layers = pool.layers()
        n = layers.object_bytes(len(blocks))
        if place == "shm":
            buf = shm_arena[offset : offset + n + 2 * GUARD]
            buf.fill_(SENTINEL)
            obj = buf[GUARD : GUARD + n]
            offset += n + 2 * GUARD
        else:
            buf, obj = guarded(n, GUARD, device="cuda" if place == "device" else "cpu", pin=place == "pinned")
        transfers.append((layers, blocks, obj))
        bufs.append(buf)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    _run(plan_gather(transfers), gpu_impl, stream=stream)
    stream.synchronize()
    for pool, blocks, buf, (_, _, obj) in zip(groups, ids, bufs, transfers, strict=True):
        np.testing.assert_array_equal(obj.cpu().numpy(), pool.expected_object(blocks))
        assert_guards(buf, GUARD)


def test_pageable_host_object_is_rejected():
    pool = POOLS["dense_bf16"](torch.Generator().manual_seed(1), device="cuda")
    layers = pool.layers()
    obj = random_bytes((layers.object_bytes(1),), torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="object on cpu is not reachable from cuda"):
        plan_scatter([(layers, [1], obj)])


def test_batched_dma_from_a_thread_that_never_used_cuda(shm_arena):
    """The store and load workers are threads of their own: the batched driver call must find (or make
    current) the device's primary context there, and order itself after the given stream's work."""
    if not cuda_batch.available():
        pytest.skip("the driver has no batched memcpy")
    groups = qwen_like_groups(torch.Generator().manual_seed(9), device="cuda")
    ids = [[3, 9], [4], [6], [2]]
    transfers, offset = [], 0
    for pool, blocks in zip(groups, ids, strict=True):
        n = pool.layers().object_bytes(len(blocks))
        transfers.append((pool.layers(), blocks, shm_arena[offset:offset + n]))
        offset += n
    plan = plan_gather(transfers)
    errors: list[BaseException] = []

    def worker():
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                copy_pages_dma(plan, batched=True)
            stream.synchronize()
        except BaseException as e:
            errors.append(e)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
    for pool, blocks, (_, _, obj) in zip(groups, ids, transfers, strict=True):
        np.testing.assert_array_equal(obj.cpu().numpy(), pool.expected_object(blocks))


@pytest.mark.parametrize("first", [0, 16])
def test_batched_dma_in_slices_moves_every_run(first, monkeypatch):
    """A plan of more runs than one slice (and a partial last slice) goes out in several driver calls on two
    streams, growing from a first slice or not: every page lands, gathered and scattered back."""
    if not cuda_batch.available():
        pytest.skip("the driver has no batched memcpy")
    monkeypatch.setattr("hybridkv_kernels.copy_dma.FIRST_SLICE_RUNS", first)
    _gather_and_scatter_back(3 * SLICE_RUNS + 7, 256)


def _gather_and_scatter_back(n: int, pb: int) -> None:
    """`n` pages of `pb` bytes, no two of them one run, gathered into pinned memory by batched DMA and scattered
    back over a sentinel: every page lands both ways."""
    pool = torch.randint(0, 256, (2 * n, pb), dtype=torch.uint8, device="cuda")
    layers = PagedLayers.from_tensors([pool], pb)
    ids = list(range(2 * n - 1, 0, -2))  # descending, every other block: no two pages make one run
    obj = torch.empty(n * pb, dtype=torch.uint8, pin_memory=True).fill_(SENTINEL)
    stream = torch.cuda.Stream()
    copy_pages_dma(plan_gather([(layers, ids, obj)]), batched=True, stream=stream)
    stream.synchronize()
    assert torch.equal(obj.view(n, pb).cuda(), pool[ids])
    want = pool[ids].clone()
    pool[ids] = SENTINEL
    copy_pages_dma(plan_scatter([(layers, ids, obj)]), batched=True, stream=stream)
    stream.synchronize()
    assert torch.equal(pool[ids], want)


@pytest.mark.parametrize("first", [0, 1, 4, 16, 40, 41, 200])
def test_a_short_plans_first_slice_and_the_rest_move_every_run(first, monkeypatch):
    """A short plan's first runs in a driver call of their own (`FIRST_SLICE_RUNS`: off, a few, half the plan's 80
    runs; more than half, and more than the plan, leave it one call), the rest after: every page lands, gathered and
    scattered back."""
    if not cuda_batch.available():
        pytest.skip("the driver has no batched memcpy")
    monkeypatch.setattr("hybridkv_kernels.copy_dma.FIRST_SLICE_RUNS", first)
    _gather_and_scatter_back(80, 4096)
