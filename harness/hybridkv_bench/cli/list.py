"""`hybridkv list`: the scenarios in ./scenarios and the model presets with their group layouts."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default="scenarios",
                        help="folder of scenario files (default: ./scenarios)")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="tensor-parallel sizes to show presets at (default: 1 2 4 8)")


def run(args: argparse.Namespace) -> int:
    from hybridkv.model.layout import LayoutError
    from hybridkv.model.presets import preset_layout, preset_names

    from hybridkv_bench.scenario.load import find_scenarios, load_scenario
    from hybridkv_bench.scenario.spec import Scenario, ScenarioError, expand_matrix

    folder = Path(args.scenarios)
    print(f"scenarios in {folder}/:")
    files = find_scenarios(folder) if folder.is_dir() else []
    if not files:
        print("  (none)")
    loaded: list[tuple[str, Scenario | None, str]] = []
    for path in files:
        try:
            loaded.append((path.stem, load_scenario(path).scenario, ""))
        except ScenarioError as e:
            loaded.append((path.stem, None, str(e)))
    width = max([len(stem) for stem, _, _ in loaded] + [len(s.name) for _, s, _ in loaded if s] + [8])
    for stem, s, error in loaded:
        if s is None:
            print(f"  {stem:<{width}}  INVALID: {error}")
            continue
        n = len(expand_matrix(s)) * len(s.workloads)
        cases = f"{n} case{'s' if n != 1 else ''}"
        print(f"  {s.name:<{width}}  {s.model.preset} tp={s.model.tp}, {cases}: {s.description}")
    print("\nmodel presets (per rank; chunk = the unified block):")
    print(f"  {'preset':<22} {'tp':>2}  {'groups':<12} {'block tok':>9} {'page bytes':>11} "
          f"{'chunk bytes':>12}")
    for name in preset_names():
        for tp in args.tp:
            try:
                layout = preset_layout(name, tp)
            except LayoutError as e:
                print(f"  {name:<22} {tp:>2}  n/a ({e})")
                continue
            kinds = "".join("A" if g.kind == "attention" else "R" for g in layout.groups)
            groups = f"{len(layout.groups)} ({kinds})"
            pages = sorted({g.page_bytes for g in layout.groups})
            blocks = sorted({g.block_tokens for g in layout.groups})
            chunk = layout.default_chunk_tokens()
            print(f"  {name:<22} {tp:>2}  {groups:<12} {'/'.join(map(str, blocks)):>9} "
                  f"{'/'.join(f'{p:,}' for p in pages):>11} {layout.chunk_bytes(chunk):>12,}")
    print("  groups: A = attention, R = recurrent (Gated DeltaNet), in vLLM's group order")
    return 0
