"""`hybridkv report RUN [--baseline FILE] [--out DIR]`: write report.md and figures for a run folder.
`hybridkv report --compare RUN... [--out DIR]`: one picture of shm vs CUDA-IPC vs pickle / torch.save."""

from __future__ import annotations

import argparse

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", help="run folder (holds run.json and requests.csv)")
    parser.add_argument("--out", default=None,
                        help="where to write (default: the run folder; with --compare: the current directory)")
    parser.add_argument("--baseline", metavar="FILE", default=None,
                        help="gate against this baseline for the verdict that opens report.md "
                             "(default: the invariants alone)")
    parser.add_argument("--compare", nargs="+", metavar="RUN", default=None,
                        help="instead of one report: compare.png of hybridkv shm, CUDA-IPC, pickle and torch.save, "
                             "each by its fastest case in these runs")
    parser.add_argument("--workload", default=None,
                        help="with --compare: the workload to compare (default: the first all runs hold)")


def run(args: argparse.Namespace) -> int:
    from .gate import BaselineError
    from .results import RunFolderError, load_run

    if (args.run is None) == (args.compare is None):
        raise UserError("give one run folder, or --compare RUN... (not both)")
    try:
        if args.compare:
            from .compare import compare

            path, table = compare(args.compare, args.out or ".", args.workload)
            incomplete = [f for f in args.compare if not load_run(f).complete]
            print(table)
            print(path)
            if incomplete:
                print(f"warning: incomplete runs compared: {', '.join(incomplete)}")
            return 0
        from .report import write_report

        complete = load_run(args.run).complete
        paths = write_report(args.run, args.out, args.baseline)
    except (RunFolderError, BaselineError) as e:
        raise UserError(str(e)) from None
    for p in paths:
        print(p)
    if not complete:
        print(f"warning: incomplete run: {args.run}; the report says so at the top")
    return 0
