"""`hybridkv gate RUN --baseline FILE | --write-baseline FILE`: exit 0 pass, 1 regression, 2 usage."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--baseline", metavar="FILE", help="baseline TOML to compare with")
    mode.add_argument("--write-baseline", metavar="FILE",
                      help="write a baseline from this run (ratios and counts, generous tolerances)")
    parser.add_argument("--force", action="store_true", help="with --write-baseline: overwrite FILE")


def run(args: argparse.Namespace) -> int:
    from .gate import BaselineError, baseline_from_run, format_table, gate, load_baseline
    from .results import RunFolderError, load_run

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
    print(format_table(result))
    for note in result.notes:
        print(f"note: {note}")
    if not loaded.complete:
        print(f"incomplete run: {args.run} ({loaded.incomplete_detail()})")
    n = len(result.failed)
    print(f"gate: {'FAIL' if n else 'pass'} ({n} of {len(result.checks)} checks failed)")
    return result.exit_code
