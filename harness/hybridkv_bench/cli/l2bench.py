"""`hybridkv l2bench FILE [--out DIR] [--quick [FACTOR]]`: L2 spill and reload against the storage's ceiling.

Exit status: 0 every document came back whole and verified; 1 a miss or a corrupt page; 2 a user mistake.
"""

from __future__ import annotations

import argparse

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="L2 workload TOML, e.g. scenarios/l2/disk.toml or scenarios/l2/redis.toml")
    parser.add_argument("--out", default=None, help="run folder (default: results/runs/<name>-<time>)")
    parser.add_argument("--quick", nargs="?", type=float, const=0.25, default=1.0, metavar="FACTOR",
                        help="shrink documents and ceiling probes by FACTOR in (0, 1] (default 0.25)")


def run(args: argparse.Namespace) -> int:
    from hybridkv_bench.calibration.storage import StorageProbeError
    from hybridkv_bench.l2.workload import L2BenchError, main

    try:
        return main(args.file, args.out, args.quick)
    except (L2BenchError, StorageProbeError) as e:
        raise UserError(str(e)) from None
