"""The `hybridkv` command. Subcommands live in their own modules, imported only when chosen, so that
`hybridkv --help` and `hybridkv serve` never import torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("hybridkv.serve_cli", "run the CPU-only cache server"),
    "bench": ("hybridkv_bench.cli_bench", "run a scenario and write a run folder"),
    "report": ("hybridkv_bench.cli_report", "write plots and a Markdown report for a run folder"),
    "gate": ("hybridkv_bench.cli_gate", "compare a run with a baseline; non-zero exit on regression"),
    "calibrate": ("hybridkv_bench.cli_calibrate", "measure this machine's copy ceilings"),
    "list": ("hybridkv_bench.cli_list", "list scenarios and model presets"),
}


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2, no traceback."""


def _load(name: str):
    module_name, _ = SUBCOMMANDS[name]
    return importlib.import_module(module_name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hybridkv", description="KV-cache offload for hybrid LLMs: a CPU-only "
                                     "cache server, and the harness that measures it.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help or a usage error
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = _load(name)
    sp = argparse.ArgumentParser(prog=f"hybridkv {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sp)
    args = sp.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except UserError as e:
        print(f"hybridkv {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridkv {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: its UserError is the class subcommands raise.
    from hybridkv.cli import main as _main

    sys.exit(_main())
