"""Layer-wise loads (`retrieve(layerwise=True)`): the copies go in the order a forward reads the layers, and
`wait_layer(name)` orders a reader of one layer after that layer's pages alone. On CUDA the reader's stream
waits on the GPU; elsewhere `wait_layer` waits for the whole load. The CUDA cases run on a GPU machine."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hybridkv.engine.copies import layer_steps
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.layout import layer_index
from hybridkv.model.presets import preset_layout
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools
from test_transfer_order import _stored as store_random

NUM_BLOCKS = 48
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_layer_steps_put_every_state_first_then_the_layers_in_forward_order():
    layout = preset_layout("qwen3.6-27b", 1)
    steps = layer_steps(layout)
    recurrent = {n for g in layout.recurrent_groups for n in layout.groups[g].layer_names}
    assert set(steps[0][0]) == recurrent
    rest = [names for names, _ in steps[1:]]
    assert all(len(names) == 1 for names in rest)  # one attention group: a step per attention layer
    indices = [layer_index(names[0]) for names in rest]
    assert indices == sorted(indices) and len(indices) == sum(
        layout.groups[g].num_layers for g in layout.attention_groups)
    named = [n for names, _ in steps for n in names]
    assert sorted(named) == sorted(n for g in layout.groups for n in g.layer_names)  # each layer once


CHUNKS = 2


@contextlib.contextmanager
def _stored(server_factory, preset: str, tp: int, device: str, seed: int):
    """A KVTransfer over random pages with CHUNKS chunks stored and looked up, the blocks to load into zeroed:
    (kv, pools, hit, source blocks, destination blocks, blocks per chunk) per group."""
    srv = server_factory(l1_gib=2.0)
    layout = preset_layout(preset, tp)
    pools = vllm_pools(layout, NUM_BLOCKS, device)
    fill_random(pools, seed)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(salt=f"lw-{preset}-{device}-{seed}")) as kv:
        tokens, src, bpc = store_random(kv, pools, alloc, CHUNKS, seed)
        hit = kv.lookup(f"load-{seed}", tokens)
        assert hit.hit_chunks == CHUNKS
        dst = [alloc.allocate(CHUNKS * b) for b in bpc]
        for g, ids in enumerate(dst):
            for t in pools[g]:
                t[ids] = 0
        yield kv, pools, hit, src, dst, bpc


def _pairs(layout, g: int, src: list[int], dst: list[int], bpc: int, chunks: int) -> list[tuple[int, int]]:
    """(source block, loaded block) pairs whose pages must be equal after the load."""
    if layout.groups[g].kind == "attention":
        return list(zip(src, dst, strict=True))
    return [(src[chunks * bpc - 1], dst[chunks * bpc - 1])]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
def test_a_layerwise_load_writes_what_was_stored_and_each_layer_can_be_awaited(server_factory, device):
    with _stored(server_factory, "tiny-hybrid", 1, device, 3) as (kv, pools, hit, src, dst, bpc):
        layout = kv.layout
        h = kv.retrieve(hit, dst, layerwise=True)
        assert (h.layer_ready is not None) == (device == "cuda")
        for g, grp in enumerate(layout.groups):
            for j, name in enumerate(grp.layer_names):
                h.wait_layer(name)
                t = pools[g][j]
                for s, d in _pairs(layout, g, src[g], dst[g], bpc[g], CHUNKS):
                    assert torch.equal(t[s], t[d]), f"{name}: block {d} is not block {s} after wait_layer"
        h.wait(30)
        assert h.nbytes == hit.nbytes


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("preset,tp", [("tiny-hybrid", 1), ("qwen3.6-27b", 8)])
def test_wait_layer_orders_a_reader_on_another_stream_after_that_layer_s_copies(server_factory, preset, tp):
    """The load's copies start behind ~0.1 s of GPU work; a reader on its own stream that waits for one
    layer reads the stored pages, and a reader that does not wait reads the zeroed blocks (the control that
    shows the check can fail)."""
    with _stored(server_factory, preset, tp, "cuda", 5) as (kv, pools, hit, src, dst, bpc):
        layout = kv.layout
        busy, reader, unordered = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        g = layout.attention_groups[0]
        j = layout.groups[g].num_layers - 1  # the last attention layer: its copies come last
        name = layout.groups[g].layer_names[j]
        blocks = torch.as_tensor(dst[g], device="cuda")  # before the sleep: a pageable upload would wait for it
        for s in (reader, unordered):  # CUDA loads a kernel at its first use, waiting for the device: not later
            with torch.cuda.stream(s):
                pools[g][j].index_select(0, blocks)
        torch.cuda.synchronize()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time; the copies start after it
            ready = torch.cuda.Event()
            ready.record(busy)
        h = kv.retrieve(hit, dst, ready=ready, layerwise=True)
        with torch.cuda.stream(unordered):
            early = pools[g][j].index_select(0, blocks)
        h.wait_layer(name, reader)
        with torch.cuda.stream(reader):
            read = pools[g][j].index_select(0, blocks)
        torch.cuda.synchronize()
        h.wait(30)
        want = pools[g][j].index_select(0, torch.as_tensor(src[g], device="cuda"))
        assert torch.equal(read, want), "a reader ordered by wait_layer saw pages before they were loaded"
        assert not torch.equal(early, want), "the unordered reader saw the loaded pages: the control proves nothing"
        assert set(h.layer_ready) == {n for grp in layout.groups for n in grp.layer_names}


def test_the_layer_steps_cut_a_load_into_parts_that_copy_every_page_once_in_forward_order(server_factory):
    """The cutting that a CUDA layer-wise load does (`PageCopies._issue_steps`), run on CPU pages."""
    from hybridkv.engine.handles import TransferHandle
    from hybridkv_kernels import build_plan

    with _stored(server_factory, "tiny-hybrid", 1, "cpu", 4) as (kv, pools, hit, src, dst, bpc):
        items = kv.wire.slots(kv._object_blocks(hit.objects, dst))
        plan = build_plan("scatter", [(kv.groups[o.group], ids, host) for o, ids, host in items])
        steps = layer_steps(kv.layout)
        h = TransferHandle("load", "parts")
        issued = kv.copies._issue_steps(h, [(None, plan, [o.group for o, _, _ in items])], steps)
        assert sorted(np.concatenate([p.dst_addr for _, p in issued]).tolist()) == sorted(plan.dst_addr.tolist())
        step_of = {(g, j): k for k, (_, pairs) in enumerate(steps) for g, j in pairs}
        groups = np.array([o.group for o, _, _ in items])
        order = [step_of[int(groups[t]), int(j)]
                 for _, p in issued for t, j in zip(p.page_transfer, p.page_layer, strict=True)]
        assert order == sorted(order)  # queued step after step
        assert set(h.layer_ready) == {n for g in kv.layout.groups for n in g.layer_names}
        for g, grp in enumerate(kv.layout.groups):
            for j in range(grp.num_layers):
                for s, d in _pairs(kv.layout, g, src[g], dst[g], bpc[g], CHUNKS):
                    assert torch.equal(pools[g][j][s], pools[g][j][d])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
def test_a_hit_split_in_two_loads_keeps_its_pins_until_the_second(server_factory, device):
    """The vLLM connector's load_mode layerwise: the GDN states of a pinned hit load first as a part of lease 0
    (releasing nothing), the attention part later under the hit's lease: both write what was stored, and the
    objects stay pinned on the server until the second load ends."""
    from dataclasses import replace

    from hybridkv.wire import protocol as P

    with _stored(server_factory, "tiny-hybrid", 1, device, 7) as (kv, pools, hit, src, dst, bpc):
        layout = kv.layout
        rec = set(layout.recurrent_groups)
        states = replace(hit, lease=0, objects=[o for o in hit.objects if o.group in rec])
        pages = replace(hit, objects=[o for o in hit.objects if o.group not in rec])
        assert states.objects and pages.objects
        kv.check_blocks(pages.objects, dst)
        with pytest.raises(ValueError):
            kv.check_blocks(pages.objects, dst[:1])
        kv.retrieve(states, dst).wait(30)
        kv.client.call(P.Health())  # behind any release the first load sent
        assert kv.client.call(P.Stats())[0].counters["leases"] == 1, "the lease-0 part released the hit's pins"
        kv.retrieve(pages, dst, layerwise=True).wait(30)
        kv.client.call(P.Health())
        assert kv.client.call(P.Stats())[0].counters["leases"] == 0, "the second part kept the hit's lease"
        for g in range(len(layout.groups)):
            for t in pools[g]:
                for s, d in _pairs(layout, g, src[g], dst[g], bpc[g], CHUNKS):
                    assert torch.equal(t[s], t[d])
