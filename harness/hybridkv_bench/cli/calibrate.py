"""`hybridkv calibrate [--device auto|cpu|cuda] [--json]`: measure this machine's copy ceilings."""

from __future__ import annotations

import argparse

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: pinned host <-> GPU copies; cpu: host memcpy; auto: cuda when a GPU is "
                             "visible, else cpu (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the calibration as JSON")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from hybridkv_bench.calibration.copies import ProbeError, calibrate

    try:
        cal = calibrate(args.device)
    except ProbeError as e:
        raise UserError(str(e)) from None
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(cal).decode(), indent=2))
        return 0
    print(f"device: {cal.device} ({cal.method}, {cal.bytes / (1 << 20):.0f} MiB x {cal.iterations}, median)")
    if cal.method == "cpu-memcpy":
        print(f"host memcpy: {cal.d2h_peak_gbps:.2f} GB/s (stands for both directions on CPU)")
    else:
        print(f"device -> pinned host: {cal.d2h_peak_gbps:.2f} GB/s")
        print(f"pinned host -> device: {cal.h2d_peak_gbps:.2f} GB/s")
        print(f"both at once: {cal.bidir_peak_gbps:.2f} GB/s; host memcpy: {cal.host_memcpy_gbps:.2f} GB/s")
        if cal.aggregate_d2h_gbps is not None:
            print(f"all {cal.gpus} GPUs at once: D2H {cal.aggregate_d2h_gbps:.2f} / "
                  f"H2D {cal.aggregate_h2d_gbps:.2f} GB/s")
    return 0
