"""`hybridkv gate RUN --baseline FILE | --write-baseline FILE`: exit 0 pass, 1 regression, 2 usage.

Prints the failed checks and a one-line verdict; the whole table goes to RUN/gate.txt (and to stdout
with --verbose).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--baseline", metavar="FILE", help="baseline TOML to compare with")
    mode.add_argument("--write-baseline", metavar="FILE",
                      help="write a baseline from this run: counts exact, orderings inside the run, speed-up floors "
                           "with the repeat spread as tolerance")
    parser.add_argument("--force", action="store_true", help="with --write-baseline: overwrite FILE")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="print every check, not only the failed ones (the run folder's gate.txt holds them)")


def run(args: argparse.Namespace) -> int:
    from hybridkv_bench.gate.baseline import BaselineError, load_baseline
    from hybridkv_bench.gate.checks import GATE_TXT, format_table, gate
    from hybridkv_bench.gate.write import baseline_from_run
    from hybridkv_bench.results.folder import RunFolderError, load_run

    try:
        loaded = load_run(args.run)
        if args.write_baseline:
            out = Path(args.write_baseline)
            if out.exists() and not args.force:
                raise UserError(f"{out} exists; pass --force to overwrite it")
            loaded.require_complete()
            text = baseline_from_run(loaded)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"wrote {out}")
            return 0
        result = gate(loaded, load_baseline(args.baseline))
    except (RunFolderError, BaselineError) as e:
        raise UserError(str(e)) from None
    table = format_table(result)
    path = Path(args.run) / GATE_TXT
    saved: Path | None = path
    try:
        path.write_text(f"baseline: {args.baseline}\n{table}\n{result.verdict()}\n")
    except OSError as e:  # a read-only run folder (a published one) still gets its verdict
        print(f"note: cannot write {path}: {e.strerror}")
        saved = None
    if args.verbose:
        print(table)
    elif result.failed:
        print(format_table(result, only_failed=True))
    for note in result.notes:
        print(f"note: {note}")
    if not loaded.complete:
        print(f"incomplete run: {args.run} ({loaded.incomplete_detail()})")
    where = f"; every check in {saved}" if saved else ""
    print(f"{result.verdict()}{where}")
    return result.exit_code
