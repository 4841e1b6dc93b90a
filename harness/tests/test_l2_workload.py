"""The L2 workload end to end on tiny objects: real servers, a real disk or Redis, ceilings in the same run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hybridkv_bench.l2.workload import L2BenchError, load_l2_bench, run_l2_bench, summary

REPO = Path(__file__).resolve().parents[2]


def _tiny(tmp_path: Path, l2: str) -> Path:
    p = tmp_path / f"{l2}.toml"
    p.write_text(f'name = "tiny_{l2}"\nl2 = "{l2}"\npreset = "tiny-hybrid"\ndocs = 3\nchunks = 2\n'
                 f'device = "cpu"\nprobe_mib = 64\n')
    return p


def test_shipped_l2_workloads_decode():
    for path in sorted((REPO / "scenarios" / "l2").glob("*.toml")):
        b = load_l2_bench(path)
        assert b.name and b.docs > 0
        assert load_l2_bench(path, 0.25).docs <= b.docs


def test_bad_file_names_the_field(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name = "x"\nl2 = "s3"\n')
    with pytest.raises(L2BenchError, match=r"bad.toml: .*\$\.l2"):
        load_l2_bench(p)
    p.write_text('name = "x"\nl2 = "fs"\ndocs = 0\n')
    with pytest.raises(L2BenchError, match="docs must be positive, got 0"):
        load_l2_bench(p)


@pytest.mark.slow  # end to end: the workload with its disk ceiling probes (43 s at load 20-40)
def test_disk_workload_reloads_every_byte_beside_the_disk_ceiling(tmp_path):
    r = run_l2_bench(load_l2_bench(_tiny(tmp_path, "fs")), tmp_path / "run")
    assert r["hit_chunks"] == r["expected_hit_chunks"] == 6 and r["corrupt_pages"] == 0
    assert r["disk_write_gbps"] > 0 and r["disk_read_gbps"] > 0 and r["l2_spill_gbps"] > 0
    assert r["reload_bytes"] == r["spill_bytes"] == r["stored_bytes"]
    assert r["adapter_put_gbps"] > 0 and r["adapter_get_gbps"] > 0
    assert (tmp_path / "run" / "l2.json").exists() and "of the write ceiling" in summary(r)
    # the ceiling is the better of 16 MiB requests and requests of the object's size (the L2's own)
    assert r["disk_object_block_bytes"] % 4096 == 0 and r["disk_object_write_gbps"] > 0
    assert r["disk_write_gbps"] == max(r["disk_16mib_write_gbps"], r["disk_object_write_gbps"])
    assert r["disk_read_gbps"] == max(r["disk_16mib_read_gbps"], r["disk_object_read_gbps"])


def test_disk_probe_refuses_a_request_size_o_direct_cannot_take(tmp_path):
    from hybridkv_bench.calibration.storage import StorageProbeError, disk_ceiling

    with pytest.raises(StorageProbeError, match="multiple of 4096 bytes, got 1000"):
        disk_ceiling(tmp_path, 1 << 20, block=1000)


@pytest.mark.slow  # end to end: two servers and a Redis (24 s at load 20-40)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_workload_is_a_cross_host_hit(tmp_path):
    r = run_l2_bench(load_l2_bench(_tiny(tmp_path, "redis")), tmp_path / "run")
    assert r["cross_host_hit"] and r["corrupt_pages"] == 0
    assert r["redis_set_gbps"] > 0 and r["redis_get_gbps"] > 0
