from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from hybridkv_bench.results.host import collect_context, git_revision, sysfs_pcie_links
from hybridkv_bench.run import probes

CUDART = "/opt/venv/lib/python3.12/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
MAPS = f"""\
7f0000000000-7f0000001000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000002000-7f0000003000 r-xp 00000000 08:01 124 {CUDART}
7f0000004000-7f0000005000 r--p 00000000 08:01 124 {CUDART}
7f0000006000-7f0000007000 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15 (deleted)
7f0000008000-7f0000009000 r-xp 00000000 08:01 126 /opt/torch/lib/libtorch_cpu.so
7f000000a000-7f000000b000 rw-p 00000000 00:00 0 [heap]
7f000000c000-7f000000d000 rw-s 00000000 00:05 7 /dev/shm/hybridkv-arena
"""


def test_synthetic_maps_with_cuda_libraries_are_detected(tmp_path: Path):
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert probes.cuda_libraries_mapped(0, maps) == [
        CUDART,
        "/usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15",
    ]
    maps.write_text("\n".join(line for line in MAPS.splitlines() if "cuda" not in line))
    assert probes.cuda_libraries_mapped(0, maps) == []


def test_a_process_without_cuda_maps_none_and_this_one_is_readable():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert probes.cuda_libraries_mapped(child.pid) == []
        usage = probes.process_usage(child.pid)
        assert usage.rss_mib > 1 and usage.cpu_s >= 0
    finally:
        child.kill()
        child.wait()
    torch = sys.modules.get("torch")
    if torch is None or torch.version.cuda is None:  # a CPU build of torch maps no CUDA library
        assert probes.cuda_libraries_mapped(os.getpid()) == []
    with pytest.raises(probes.ProbeError, match="cannot read"):
        probes.cuda_libraries_mapped(0, "/nonexistent/maps")


def test_process_usage_of_this_process_is_positive():
    sum(i * i for i in range(200_000))
    u = probes.process_usage(os.getpid())
    assert u.rss_mib > 10 and u.cpu_s > 0
    with pytest.raises(probes.ProbeError):
        probes.process_usage(2**22 + 12345)


def _fake_nvml(processes_per_device: list[list[tuple[int, int | None]]], fail_init: bool = False):
    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("no driver")

    return types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(processes_per_device),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in processes_per_device[h]],
    )


def test_server_vram_from_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: not measurable
    assert probes.server_vram_mib(123) is None
    two_gpus = [[(123, 612 << 20), (7, 1 << 30)], [(123, 1 << 20)]]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(two_gpus))
    assert probes.server_vram_mib(123) == 613.0
    assert probes.server_vram_mib(99, control_pid=7) == 0.0  # engine visible, server absent: truly 0
    assert probes.server_vram_mib(99, control_pid=8) is None  # engine invisible: another PID namespace
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([[(123, None)]]))
    assert probes.server_vram_mib(123) is None  # driver hides per-process memory
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([], fail_init=True))
    assert probes.server_vram_mib(123) is None


def test_sample_server_metrics_names():
    s = probes.sample_server(os.getpid())
    assert set(s.metrics()) == {"server_vram_mib", "server_cuda_mapped", "server_rss_mib", "server_cpu_s"}


def test_context_is_collected_without_torch(tmp_path: Path):
    code = ("import sys, json; from hybridkv_bench.results.host import collect_context; "
            "c = collect_context(['x']); assert 'torch' not in sys.modules; print(json.dumps(c))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ}, cwd=Path(__file__).parents[2])
    assert '"git_sha"' in out.stdout
    ctx = collect_context(["x"])
    for key in ("git_sha", "git_dirty", "host", "cpu_model", "cpu_count", "mem_gib", "gpu", "driver",
                "pcie_link", "versions", "started_at", "finished_at", "argv"):
        assert key in ctx
    assert set(ctx["versions"]) >= {"python", "torch", "triton", "pyzmq", "msgspec", "hybridkv"}
    assert git_revision(tmp_path) == (None, None)


def test_sysfs_pcie_links(tmp_path: Path):
    for name, vendor, cls in (("0000:01:00.0", "0x10de", "0x030200"), ("0000:02:00.0", "0x8086", "0x030000")):
        d = tmp_path / name
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        (d / "current_link_speed").write_text("32.0 GT/s PCIe\n")
        (d / "current_link_width").write_text("16\n")
    assert sysfs_pcie_links(tmp_path) == ["0000:01:00.0: 32.0 GT/s PCIe x16"]
    assert sysfs_pcie_links(tmp_path / "none") is None


def test_a_tree_file_names_the_tree_a_copy_was_made_from(tmp_path: Path):
    """A GPU host runs a copy of the working tree whose .git may be missing or stale: the tree file wins."""
    from hybridkv_bench.results.host import TREE_FILE

    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / TREE_FILE).write_text(f"{sha} dirty\n")
    assert git_revision(tmp_path) == (sha, True)
    (tmp_path / TREE_FILE).write_text("not a tree\n")
    assert git_revision(tmp_path) == (None, None)  # malformed: ignored, and no checkout here


def test_a_copy_inside_another_checkout_names_its_own_tree_or_none(tmp_path: Path):
    """A tree laid out inside another repository (the device's `.device/cand` under the project's checkout) must not
    carry the enclosing repository's HEAD: its tree file names it (sha alone, as `git rev-parse` writes it), else
    nothing does."""
    from hybridkv_bench.results.host import TREE_FILE

    outer = tmp_path / "outer"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    copy = outer / ".device" / "cand"
    copy.mkdir(parents=True)
    assert git_revision(copy) == (None, None)
    sha = "89abcdef0123456789abcdef0123456789abcdef"
    (copy / TREE_FILE).write_text(sha + "\n")
    assert git_revision(copy) == (sha, None)
    head = subprocess.run(["git", "-C", str(outer), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert git_revision(outer) == (head.strip(), False)
