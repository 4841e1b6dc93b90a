"""Plans: vectorized addresses equal a per-page loop, and bad input fails before any byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv_kernels import HOLE, PagedLayers, plan_gather, plan_pages, plan_scatter
from hybridkv_kernels.copy_dma import copy_runs
from kernel_pools import POOLS, guarded, qwen_like_groups, random_bytes


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(42)


def _qwen_scale(gen, chunks=71, layers=16, page_bytes=64):
    """71 chunks x 4 groups x 16 layers of one-block objects: 4544 pages, as a 56k-token Qwen3.6 store."""
    blocks = 4 * chunks + 5
    groups = [p.layers() for p in qwen_like_groups(gen, layers, 4, blocks, page_bytes)]
    perm = torch.randperm(blocks, generator=gen).tolist()
    arena = torch.empty(4 * chunks * layers * page_bytes, dtype=torch.uint8)
    objs = arena.view(4 * chunks, layers * page_bytes)
    transfers = [(groups[g], [perm[g * chunks + c]], objs[g * chunks + c])
                 for g in range(4) for c in range(chunks)]
    return transfers


def test_vectorized_addresses_equal_a_per_page_loop(gen):
    transfers = _qwen_scale(gen)
    plan = plan_gather(transfers)
    src, dst = [], []
    for layers, ids, obj in transfers:
        for layer, v in enumerate(layers.views):
            for j, b in enumerate(ids):
                src.append(v[b].data_ptr())
                dst.append(obj.data_ptr() + (layer * len(ids) + j) * layers.page_bytes)
    assert plan.num_pages == 4544
    np.testing.assert_array_equal(plan.src_addr, src)
    np.testing.assert_array_equal(plan.dst_addr, dst)


def test_plan_build_is_vectorized(gen, benchmark):
    # Timed by `nox -s microbench` against its saved baseline (a timing assert here would only be noise).
    transfers = _qwen_scale(gen)
    plan = benchmark(plan_gather, transfers)
    assert plan.num_pages == sum(t[0].num_layers * len(t[1]) for t in transfers)


def test_dma_coalesces_consecutive_blocks(gen):
    pool = POOLS["dense_bf16"](gen)  # page stride == page_bytes
    layers = pool.layers()
    ids = [4, 5, 6, 9, 2, 3]
    _, obj = guarded(layers.object_bytes(len(ids)))
    starts, lengths = copy_runs(plan_gather([(layers, ids, obj)]))
    # Per layer: [4,5,6], [9], [2,3]; layers are separate allocations in no order, so runs never join.
    assert lengths.tolist() == [3, 1, 2] * pool.num_layers
    assert starts.tolist() == [0, 3, 4, 6, 9, 10, 12, 15, 16]


def test_strided_pages_never_coalesce(gen):
    pool = POOLS["shared_fp32"](gen)  # page stride > page_bytes
    layers = pool.layers()
    _, obj = guarded(layers.object_bytes(3))
    _, lengths = copy_runs(plan_gather([(layers, [1, 2, 3], obj)]))
    assert lengths.tolist() == [1] * 3 * pool.num_layers


def _engine_bytes(pool):
    return pool.raw.clone()


@pytest.mark.parametrize("bad", [-2, 11, 1000])
def test_block_id_out_of_range(gen, bad):
    pool = POOLS["dense_bf16"](gen)
    before = _engine_bytes(pool)
    payload = random_bytes((pool.layers().object_bytes(2),), gen)
    with pytest.raises(ValueError, match=rf"transfer 0: block id {bad} is out of range \[0, 11\)"):
        plan_scatter([(pool.layers(), [3, bad], payload)])
    assert torch.equal(pool.raw, before)


def test_a_hole_is_a_scatter_page_written_nowhere_and_no_gather_may_have_one(gen):
    pool = POOLS["dense_bf16"](gen)
    layers = pool.layers()
    payload = random_bytes((layers.object_bytes(3),), gen)
    plan = plan_scatter([(layers, [HOLE, 5, HOLE], payload)])
    assert plan.num_pages == pool.num_layers  # one page per layer: block 5's, the object's page j=1
    np.testing.assert_array_equal(plan.dst_addr, [v[5].data_ptr() for v in layers.views])
    np.testing.assert_array_equal(plan.src_addr, [payload.data_ptr() + (layer * 3 + 1) * layers.page_bytes
                                                  for layer in range(pool.num_layers)])
    before = _engine_bytes(pool)
    with pytest.raises(ValueError, match=r"transfer 0: block id -1 \(a hole\) in a gather"):
        plan_gather([(layers, [2, HOLE], torch.empty(layers.object_bytes(2), dtype=torch.uint8))])
    assert torch.equal(pool.raw, before)


def test_holes_in_a_two_half_plan_leave_other_transfers_in_place(gen):
    pool = POOLS["dense_bf16"](gen)
    layers = pool.layers()
    half = plan_pages("scatter", [(layers, [HOLE, HOLE]), (layers, [1, HOLE, 2]), (layers, [3])])
    objs = [random_bytes((layers.object_bytes(n),), gen) for n in (2, 3, 1)]
    plan = half.bind([objs[0], None, objs[2]])  # the first transfer is all holes: no page of it moves
    assert plan.num_pages == pool.num_layers
    np.testing.assert_array_equal(plan.dst_addr, [v[3].data_ptr() for v in layers.views])
    plan = half.bind(objs)
    assert plan.num_pages == 3 * pool.num_layers
    assert sorted(set(plan.page_transfer.tolist())) == [1, 2]


def test_wrong_object_size(gen):
    pool = POOLS["dense_bf16"](gen)
    want = pool.layers().object_bytes(2)
    with pytest.raises(ValueError, match=rf"object has {want - 1} B, expected {want} B"):
        plan_gather([(pool.layers(), [1, 2], torch.empty(want - 1, dtype=torch.uint8))])


def test_object_dtype_and_contiguity(gen):
    layers = POOLS["shared_fp32"](gen).layers()
    n = layers.object_bytes(1)
    with pytest.raises(ValueError, match="object dtype must be torch.uint8, got torch.float32"):
        plan_gather([(layers, [0], torch.empty(n // 4))])
    with pytest.raises(ValueError, match="object must be contiguous bytes"):
        plan_gather([(layers, [0], torch.empty(2 * n, dtype=torch.uint8)[::2])])


def test_mismatched_page_bytes_need_their_own_plan(gen):
    a, b = POOLS["dense_bf16"](gen).layers(), POOLS["shared_fp32"](gen).layers()
    with pytest.raises(ValueError, match="transfer 1: page_bytes 100 differs from the plan's 222"):
        plan_gather([(a, [0], torch.empty(a.object_bytes(1), dtype=torch.uint8)),
                     (b, [0], torch.empty(b.object_bytes(1), dtype=torch.uint8))])


def test_duplicate_scatter_target_in_one_object(gen):
    pool = POOLS["padded_fp8"](gen)
    before = _engine_bytes(pool)
    payload = random_bytes((pool.layers().object_bytes(3),), gen)
    with pytest.raises(ValueError, match="transfer 0 layer 0 block 4 and transfer 0 layer 0 block 4"):
        plan_scatter([(pool.layers(), [4, 1, 4], payload)])
    assert torch.equal(pool.raw, before)


def test_same_block_from_two_groups_of_a_shared_pool(gen):
    # Groups share the raw tensors, so one block id in two groups is one engine page written twice.
    g0, g1 = qwen_like_groups(gen, layers=2, groups=2)
    before = _engine_bytes(g0)
    la, lb = g0.layers(), g1.layers()
    objs = [random_bytes((la.object_bytes(1),), gen) for _ in range(2)]
    with pytest.raises(ValueError, match=r"transfer 0 layer 0 block 6 and transfer 1 layer 0 block 6"):
        plan_scatter([(la, [6], objs[0]), (lb, [6], objs[1])])
    assert torch.equal(g0.raw, before)


def test_gather_into_overlapping_objects(gen):
    layers = POOLS["dense_bf16"](gen).layers()
    n = layers.object_bytes(1)
    arena = torch.empty(2 * n, dtype=torch.uint8)
    with pytest.raises(ValueError, match="destination pages overlap"):
        plan_gather([(layers, [0], arena[:n]), (layers, [1], arena[10 : 10 + n])])


def test_bad_block_id_types(gen):
    layers = POOLS["dense_bf16"](gen).layers()
    obj = torch.empty(layers.object_bytes(2), dtype=torch.uint8)
    with pytest.raises(ValueError, match="block ids must be a 1-d sequence of ints, got float64"):
        plan_gather([(layers, [0.0, 1.0], obj)])


def test_layers_must_be_paged_layers(gen):
    pool = POOLS["dense_bf16"](gen)
    with pytest.raises(ValueError, match="layers must be PagedLayers, got list"):
        plan_gather([(pool.tensors, [0], torch.empty(1, dtype=torch.uint8))])


def test_empty_plan_is_rejected():
    with pytest.raises(ValueError, match="at least one transfer"):
        plan_gather([])


def test_zero_block_transfer_is_a_no_op(gen):
    layers = PagedLayers.from_views([torch.zeros(4, 32, dtype=torch.uint8)])
    plan = plan_gather([(layers, [], torch.empty(0, dtype=torch.uint8))])
    assert plan.num_pages == 0


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_engine_half_bound_later_equals_a_plan_of_the_bound_transfers(gen, direction):
    """plan_pages(...).bind(objects) with some objects left out (None) is the plan of the others."""
    from hybridkv_kernels import build_plan, plan_pages

    transfers = _qwen_scale(gen, chunks=5)
    half = plan_pages(direction, [(layers, ids) for layers, ids, _ in transfers])
    keep = [i % 3 != 1 for i in range(len(transfers))]
    plan = half.bind([obj if k else None for (_, _, obj), k in zip(transfers, keep, strict=True)])
    ref = build_plan(direction, [t for t, k in zip(transfers, keep, strict=True) if k])
    assert plan.num_pages == ref.num_pages == 16 * sum(keep)
    for f in ("src_addr", "dst_addr", "page_transfer", "page_layer", "engine_storage"):
        np.testing.assert_array_equal(getattr(plan, f), getattr(ref, f), err_msg=f)
    assert plan.elem_bytes == ref.elem_bytes
    assert [t.obj.data_ptr() for t in plan.transfers] == [t.obj.data_ptr() for t in ref.transfers]
    with pytest.raises(ValueError, match="at least one transfer"):
        half.bind([None] * len(transfers))
    with pytest.raises(ValueError, match="objects given"):
        half.bind([None])
    wrong = [obj for _, _, obj in transfers]
    wrong[2] = wrong[2][:-1]  # one byte short: refused, named by its index among all transfers
    with pytest.raises(ValueError, match="transfer 2: object has"):
        half.bind(wrong)


@pytest.mark.parametrize("impl", ["torch", "dma"])
def test_a_part_of_a_plan_moves_its_pages_alone_and_refuses_indices_outside_it(gen, impl):
    from hybridkv_kernels import run_plan

    pool = POOLS["dense_bf16"](gen)
    layers = pool.layers()
    ids = [4, 5, 6, 9]
    _, obj = guarded(layers.object_bytes(len(ids)))
    obj.zero_()
    plan = plan_gather([(layers, ids, obj)])
    part = plan.take(np.flatnonzero(plan.page_layer == 1))  # one layer's pages, as a layer-wise load cuts them
    assert part.num_pages == len(ids) and set(part.page_layer.tolist()) == {1}
    run_plan(part, impl)
    pb = layers.page_bytes
    per_layer = obj.view(pool.num_layers, len(ids), pb)
    for j, b in enumerate(ids):
        assert torch.equal(per_layer[1, j], layers.views[1][b][:pb])
    assert not per_layer[0].any() and not per_layer[2].any()  # the other layers' pages were not copied
    with pytest.raises(ValueError, match="1-d selection"):
        plan.take(np.array([plan.num_pages]))


def _reference_pages(direction, transfers):
    """Per page, in plan order, by a loop over objects, layers and blocks: (src, dst, transfer index among the
    bound ones, layer, engine storage); a scatter's hole writes nowhere."""
    rows, bound = [], 0
    for layers, ids, obj in transfers:
        if obj is None:
            continue
        for layer, v in enumerate(layers.views):
            for j, b in enumerate(ids):
                if b == HOLE:
                    continue
                engine = v[b].data_ptr()
                o = obj.data_ptr() + (layer * len(ids) + j) * layers.page_bytes
                rows.append((engine, o, bound, layer, v.untyped_storage().data_ptr()) if direction == "gather"
                            else (o, engine, bound, layer, v.untyped_storage().data_ptr()))
        bound += 1
    return rows


def _reference_runs(plan):
    """Runs of pages adjacent on both sides and inside one allocation each side, by a loop."""
    starts, lengths = [], []
    stor = [t.obj.untyped_storage().data_ptr() for t in plan.transfers]
    for p in range(plan.num_pages):
        if p and (plan.src_addr[p] - plan.src_addr[p - 1] == plan.page_bytes
                  and plan.dst_addr[p] - plan.dst_addr[p - 1] == plan.page_bytes
                  and plan.engine_storage[p] == plan.engine_storage[p - 1]
                  and stor[plan.page_transfer[p]] == stor[plan.page_transfer[p - 1]]):
            lengths[-1] += 1
        else:
            starts.append(p)
            lengths.append(1)
    return starts, lengths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_plans_and_runs_equal_a_loop_over_random_transfers(direction, seed):
    """Random transfers over groups sharing one pool (multi-block objects, runs of consecutive blocks, a scatter's
    holes, some transfers left unbound, objects in one arena and alone): the plan's pages and the DMA runs
    equal a per-page loop's."""
    from hybridkv_kernels.copy_dma import dma_runs

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    groups = [p.layers() for p in qwen_like_groups(gen, layers=3, groups=3, blocks=40, page_bytes=64)]
    arena = torch.empty(1 << 16, dtype=torch.uint8)
    free = iter(rng.permutation(40).tolist())
    transfers, off = [], 0
    for t in range(int(rng.integers(1, 9))):
        layers = groups[int(rng.integers(0, 3))]
        n = int(rng.integers(1, 4))
        if rng.random() < 0.5 and t:  # consecutive blocks: runs join within a layer
            first = next(free)
            ids = [min(first + j, 39) for j in range(n)] if first + n <= 40 else [first]
            ids = list(dict.fromkeys(ids))
        else:
            ids = [next(free) for _ in range(n)]
        if direction == "scatter" and rng.random() < 0.3:
            ids[int(rng.integers(0, len(ids)))] = HOLE
        size = layers.object_bytes(len(ids))
        if rng.random() < 0.7:  # a slot of the arena, right after the last one (runs may cross objects)
            obj = arena[off:off + size]
            off += size
        else:
            obj = torch.empty(size, dtype=torch.uint8)
        transfers.append((layers, ids, obj if rng.random() < 0.8 or t == 0 else None))
    try:  # the same engine block in two transfers of a scatter is refused; draw blocks without it
        half = plan_pages(direction, [(layers, ids) for layers, ids, _ in transfers])
        plan = half.bind([obj for _, _, obj in transfers])
    except ValueError as e:
        assert "overlap" in str(e)
        return
    ref = _reference_pages(direction, transfers)
    got = list(zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.page_transfer.tolist(),
                   plan.page_layer.tolist(), plan.engine_storage.tolist(), strict=True))
    assert got == ref
    starts, lengths = copy_runs(plan)
    assert (starts.tolist(), lengths.tolist()) == _reference_runs(plan)
    dst, src, sizes = dma_runs(plan)
    assert dst.dtype == src.dtype == sizes.dtype == np.uint64
    assert dst.tolist() == plan.dst_addr[starts].tolist() and src.tolist() == plan.src_addr[starts].tolist()
    assert sizes.tolist() == [n * plan.page_bytes for n in lengths.tolist()]
