"""`hybridkv report RUN [--out DIR]`: write report.md and figures for a run folder."""

from __future__ import annotations

import argparse

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder (holds run.json and requests.csv)")
    parser.add_argument("--out", default=None, help="where to write the report (default: the run folder)")


def run(args: argparse.Namespace) -> int:
    from .report import write_report
    from .results import RunFolderError, load_run

    try:
        complete = load_run(args.run).complete
        paths = write_report(args.run, args.out)
    except RunFolderError as e:
        raise UserError(str(e)) from None
    for p in paths:
        print(p)
    if not complete:
        print(f"warning: incomplete run: {args.run}; the report says so at the top")
    return 0
