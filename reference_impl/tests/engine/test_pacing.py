"""Pacing in the transfer config (`max_link_fraction`, `max_compute_cost`): checked at construction, the share of
the link each direction gets, and on a GPU the engine's paced loads and stores land byte-exact at their pace."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hybridkv.engine.config import COMPUTE_COST_AT_FULL_LINK, MIN_LINK_FRACTION
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools


@pytest.mark.parametrize("bad", [dict(max_link_fraction=0.0), dict(max_link_fraction=1.2),
                                 dict(max_link_fraction=MIN_LINK_FRACTION / 2), dict(max_link_fraction=float("nan")),
                                 dict(max_compute_cost=-0.01), dict(max_compute_cost=1.0),
                                 dict(max_compute_cost=float("nan")), dict(max_compute_cost=0.0001),
                                 dict(link_gbps=-1.0), dict(link_gbps=float("inf"))])
def test_a_bad_pacing_setting_is_refused_naming_its_value(bad) -> None:
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{name}.*{value!r}|{value!r}.*{name}|{name} {value!r}"):
        TransferConfig(**bad)


def test_unpaced_by_default() -> None:
    cfg = TransferConfig()
    assert cfg.link_fraction("load") == cfg.link_fraction("store") == 1.0


def test_a_compute_cost_cap_paces_each_direction_to_what_costs_that() -> None:
    """Loads cost memory-bound compute about four times what stores do at the full link: a 3% cap paces loads
    to under half the link and leaves stores unpaced; a link cap below that holds for both."""
    cfg = TransferConfig(max_compute_cost=0.03)
    assert cfg.link_fraction("load") == pytest.approx(0.03 / COMPUTE_COST_AT_FULL_LINK["load"])
    assert 0.4 < cfg.link_fraction("load") < 0.5
    assert cfg.link_fraction("store") == 1.0
    both = TransferConfig(max_compute_cost=0.03, max_link_fraction=0.3)
    assert both.link_fraction("load") == both.link_fraction("store") == 0.3
    assert TransferConfig(max_link_fraction=0.8).link_fraction("load") == 0.8


def test_on_a_cpu_a_paced_config_moves_the_same_bytes_unpaced(server_factory) -> None:
    """CPU copies are synchronous and use no copy engine: a pace does not apply there (no pacers), and the
    transfers are what they are unpaced."""
    _round_trip("cpu", server_factory(), TransferConfig(max_link_fraction=0.2, salt="paced-cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("copy_engine", ["dma", "triton"])
def test_paced_stores_and_loads_land_byte_exact_on_cuda(server_factory, copy_engine) -> None:
    """At a fifth of a pretended 2 GB/s link, the 13 MB of a Qwen3.6-27B TP8 chunk's objects take at least the
    paced time each way, and what the load wrote is what the store read."""
    cfg = TransferConfig(max_link_fraction=0.2, link_gbps=2.0, copy_engine=copy_engine, salt=f"paced-{copy_engine}")
    took = _round_trip("cuda", server_factory(l1_gib=1.0), cfg, layout_name=("qwen3.6-27b", 8))
    assert all(t >= 0.5 * 13e6 / 2e9 / 0.2 for t in took), took


def _round_trip(device: str, srv, cfg: TransferConfig, layout_name=("tiny-hybrid", 1)) -> list[float]:
    layout = preset_layout(*layout_name)
    num_blocks = 8 * len(layout.groups)
    pools = vllm_pools(layout, num_blocks, device)
    fill_random(pools, 3)
    alloc = BlockAllocator(num_blocks)
    took = []
    with KVTransfer(srv.endpoint, layout, pools, cfg) as kv:
        assert bool(kv.copies.pacers) == (device == "cuda")
        ct = kv.chunk_tokens
        src, dst = ([alloc.allocate(ct // g.block_tokens) for g in layout.groups] for _ in range(2))
        tokens = np.random.default_rng(4).integers(0, 150_000, ct)
        t0 = time.perf_counter()
        kv.store("s", tokens, src).wait_committed(30)
        took.append(time.perf_counter() - t0)
        kv.end_session("s")
        hit = kv.lookup("l", tokens)
        assert hit.hit_chunks == 1
        t0 = time.perf_counter()
        kv.retrieve(hit, dst).wait(30)
        took.append(time.perf_counter() - t0)
        kv.end_session("l")
        if device == "cuda":
            torch.cuda.synchronize()
        for g in range(len(layout.groups)):
            for t in pools[g]:
                assert torch.equal(t[dst[g]], t[src[g]])
    return took
