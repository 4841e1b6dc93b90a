"""`hybridkv report RUN [--baseline FILE] [--out DIR]`: write report.md, report.html and figures for a run folder.
`hybridkv report --compare RUN RUN... [--out DIR]`: every case of every run side by side, with the changes against
the first run and the regressions beyond noise (report.regression) (compare.md, compare.html, compare.png)."""

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
                        help="instead of one report: every case of these runs side by side, per case and path, with "
                             "each figure's change against the first run and the regressions beyond noise (at least 5 "
                             "repeats a run, a rank test, a 10%% change) (compare.md, compare.html, compare.png)")
    parser.add_argument("--workload", default=None,
                        help="with --compare: the workload drawn in compare.png (default: the first; the tables hold "
                             "every workload)")


def run(args: argparse.Namespace) -> int:
    from hybridkv_bench.gate.baseline import BaselineError
    from hybridkv_bench.results.folder import RunFolderError, load_run

    if (args.run is None) == (args.compare is None):
        raise UserError("give one run folder, or --compare RUN... (not both)")
    try:
        if args.compare:
            from hybridkv_bench.report.compare import compare

            paths, regressed = compare(args.compare, args.out or ".", args.workload)
            incomplete = [f for f in args.compare if not load_run(f).complete]
            print(f"{len(regressed)} figures regressed beyond noise" + (":" if regressed else ""))
            for line in regressed:
                print(f"  {line}")
            for p in paths:
                print(p)
            if incomplete:
                print(f"warning: incomplete runs compared: {', '.join(incomplete)}")
            return 0
        from hybridkv_bench.report.markdown import write_report

        complete = load_run(args.run).complete
        paths = write_report(args.run, args.out, args.baseline)
    except (RunFolderError, BaselineError) as e:
        raise UserError(str(e)) from None
    for p in paths:
        print(p)
    if not complete:
        print(f"warning: incomplete run: {args.run}; the report says so at the top")
    return 0
