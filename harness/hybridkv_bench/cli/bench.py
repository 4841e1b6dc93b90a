"""`hybridkv bench SCENARIO [--quick [FACTOR]] [--out DIR] [--server ENDPOINT] [--cases GLOB] [--device ...]`.

Exit status: 0 every case ran and verified; 1 some case failed (the run folder says which and why);
2 a user mistake (one line on stderr); 130 interrupted (the run folder is kept, marked incomplete).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hybridkv.cli import UserError

DEFAULT_QUICK = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario TOML file (see `hybridkv list`)")
    parser.add_argument("--out", default=None, help="run folder to write (default: results/runs/<scenario>-<time>)")
    parser.add_argument("--quick", nargs="?", type=float, const=DEFAULT_QUICK, default=None, metavar="FACTOR",
                        help=f"shrink the scenario by FACTOR in (0, 1] (default {DEFAULT_QUICK}): fewer, shorter "
                             "prompts; every workload keeps its point")
    parser.add_argument("--server", default=None, metavar="ENDPOINT",
                        help="use this running server instead of a fresh one per case (server probes not measured)")
    parser.add_argument("--cases", default=None, metavar="GLOB",
                        help="run only cases whose name or workload/name matches, e.g. 'shm-*' or 'fan_out/*'")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="where the engine's KV pools live (default: the scenario's)")
    parser.add_argument("--no-report", action="store_true", help="skip report.md and the plots")
    parser.add_argument("--planted-slowdown", type=float, default=0.0, metavar="FRACTION",
                        help="for testing `report --compare` only: each timed store and load of the sim engine "
                             "waits this fraction of its own time more (0.25: rates at 1/1.25, 20%% slower); "
                             "recorded in run.json and on the report's first line (default: none)")


def run(args: argparse.Namespace) -> int:
    from hybridkv_bench.engines.registry import engine_kind
    from hybridkv_bench.report.markdown import write_report
    from hybridkv_bench.run.options import BenchError, BenchOptions
    from hybridkv_bench.run.runner import run_bench
    from hybridkv_bench.scenario.load import load_scenario
    from hybridkv_bench.scenario.spec import ScenarioError

    try:
        sf = load_scenario(args.scenario)
        if args.quick is not None:
            sf = sf.scaled(args.quick)
        for name, value in engine_kind(sf.scenario.engine).env:
            os.environ.setdefault(name, value)  # the engine kind's library reads these as it is imported
        options = BenchOptions(out=Path(args.out) if args.out else None, server=args.server, cases=args.cases,
                               device=args.device, planted_slowdown=args.planted_slowdown)
        outcome = run_bench(sf, options)
    except (ScenarioError, BenchError) as e:
        raise UserError(str(e)) from None
    except KeyboardInterrupt:
        print("hybridkv bench: interrupted; servers stopped, the run folder is marked incomplete", file=sys.stderr)
        return 130
    if not args.no_report:
        report = write_report(outcome.folder)[0]
        print(f"report: {report}")
    print(f"run folder: {outcome.folder}")
    if outcome.failed:
        print(f"hybridkv bench: {len(outcome.failed)} of {outcome.cases} cases failed: {', '.join(outcome.failed)}",
              file=sys.stderr)
        return 1
    return 0
