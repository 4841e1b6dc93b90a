"""The code's shape, checked: no import cycles (type-only imports included), the engine never imports the server,
the server's layers import only downwards (front -> ops -> books -> l2 -> machinery), the core below the server and
the engine is folders that import only downwards (wire -> model -> memory), the harness's folders and top modules
import each other in no loop (so they stack with no up-import), the harness's top package stays small, no source
file over 600 lines, and the wire formats are named in few modules (the rest read `hybridkv.wire.wire_formats`).
Imports are read from the source (ast); `import_graph(typing=False)` leaves out the ones under `if TYPE_CHECKING:`.

    python reference_impl/tests/test_structure.py   # prints the figures these tests hold to
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"hybridkv": ROOT / "reference_impl" / "hybridkv", "hybridkv_kernels": ROOT / "kernels" / "hybridkv_kernels",
            "hybridkv_bench": ROOT / "harness" / "hybridkv_bench"}
# File size is a guide: a file splits where its ideas part, never to get under a number (cuts made on line count
# left twins such as the lookup's one-turn and in-turns modules). This is the bound past which a file surely holds
# two ideas.
MAX_LINES = 600
MAX_HARNESS_TOP = 12
MAX_FORMAT_MODULES = 4
# The server's folders, top to bottom: a module may import its own folder and the folders below it, never above.
SERVER_LAYERS = ("front", "ops", "books", "l2", "machinery")
# The core under the server and the engine, top to bottom: a module may import its own folder and the folders below
# it, nothing else of hybridkv.
CORE_LAYERS = ("wire", "model", "memory")
# The modules left at hybridkv's top: the package's face and the operator command (`hybridkv`, its settings
# sources and `hybridkv status`), which the engine and the server never import.
CORE_TOP = ("__init__.py", "cli.py", "settings_sources.py", "status.py")
# Below the edge nothing reads the environment (settings are passed down); these reads are the named exceptions.
ENV_READS_BELOW_THE_EDGE = {
    "hybridkv_kernels.dispatch",  # TRITON_INTERPRET: Triton's own switch (its jit then runs on the CPU), not ours
}


@cache
def modules() -> dict[str, Path]:
    out = {}
    for base in PACKAGES.values():
        for p in sorted(base.rglob("*.py")):
            parts = list(p.relative_to(base.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(c) for c in ast.walk(n))
    return skip


@cache
def import_graph(typing: bool = False) -> dict[str, frozenset[str]]:
    """Module -> the project modules it imports (the deepest existing module each import names); `typing`:
    with the imports under `if TYPE_CHECKING:`."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree) if not typing else set()
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = package[: len(package) - (n.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in n.names] + [base]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
                    break
        graph[name] = frozenset(edges)
    return graph


def import_cycles(typing: bool = False) -> list[list[str]]:
    """Strongly connected groups of more than one module; `typing`: counting the imports under `if TYPE_CHECKING:`
    too."""
    return strong_groups(import_graph(typing))


def strong_groups(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node of `graph` (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def server_layer(module: str) -> int | None:
    """The index in SERVER_LAYERS of a server module's folder (None: not in a layer folder)."""
    parts = module.split(".")
    if parts[:2] != ["hybridkv", "server"] or len(parts) < 3:
        return None
    return SERVER_LAYERS.index(parts[2]) if parts[2] in SERVER_LAYERS else None


def upward_imports() -> list[tuple[str, str]]:
    """(importer, imported) pairs where a server module imports a folder above its own (type-only included)."""
    out = []
    for a, bs in import_graph(typing=True).items():
        la = server_layer(a)
        out.extend((a, b) for b in sorted(bs) if (lb := server_layer(b)) is not None and (la is None or lb < la)
                   and a.startswith("hybridkv.server."))
    return sorted(out)


def core_layer(module: str) -> int | None:
    """The index in CORE_LAYERS of a core module's folder (None: not in a core folder)."""
    parts = module.split(".")
    return CORE_LAYERS.index(parts[1]) if parts[0] == "hybridkv" and len(parts) > 2 and parts[1] in CORE_LAYERS \
        else None


def core_imports_not_downwards() -> list[tuple[str, str]]:
    """(importer, imported) pairs where a core module imports hybridkv outside its own folder and those below it
    (type-only imports included)."""
    out = []
    for a, bs in import_graph(typing=True).items():
        if (la := core_layer(a)) is None:
            continue
        out.extend((a, b) for b in sorted(bs) if b.startswith("hybridkv.")
                   and ((lb := core_layer(b)) is None or lb < la))
    return sorted(out)


def harness_room(module: str) -> str | None:
    """The harness's room a module is in: its folder under hybridkv_bench, or the top module itself (None: not
    the harness's, or its package face)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "hybridkv_bench" and len(parts) > 1 else None


def harness_room_graph() -> dict[str, frozenset[str]]:
    """Room -> the other rooms its modules import (type-only and in-function imports included)."""
    rooms: dict[str, set[str]] = {}
    for a, bs in import_graph(typing=True).items():
        if (ra := harness_room(a)) is None:
            continue
        rooms.setdefault(ra, set()).update(rb for b in bs if (rb := harness_room(b)) not in (None, ra))
    return {r: frozenset(bs) for r, bs in rooms.items()}


def harness_room_cycles() -> list[list[str]]:
    """The groups of the harness's rooms that import each other round."""
    return strong_groups(harness_room_graph())


def room_ties(group: list[str]) -> list[str]:
    """The module imports between the rooms of `group`: each lies on a loop of the group's rooms."""
    return sorted(f"{a} -> {b}" for a, bs in import_graph(typing=True).items() if harness_room(a) in group
                  for b in bs if harness_room(b) in group and harness_room(b) != harness_room(a))


def env_reads_below_the_edge() -> list[str]:
    """Server modules below the front door, kernel modules and harness modules below its CLI that read os.environ /
    os.getenv."""
    out = []
    for name, path in modules().items():
        below = ((name.startswith("hybridkv.server.") and server_layer(name) != 0)
                 or name.startswith("hybridkv_kernels")
                 or (name.startswith("hybridkv_bench.") and not name.startswith("hybridkv_bench.cli")))
        if below and any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "environb")
                         for n in ast.walk(ast.parse(path.read_text()))):
            out.append(name)
    return sorted(out)


def format_literal_modules() -> dict[str, list[str]]:
    """Modules that spell a wire format's name as a string constant (docstrings aside)."""
    from hybridkv.wire.wire_formats import FORMATS

    names = set(FORMATS)
    out = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        docs = {id(b.body[0].value) for b in ast.walk(tree)
                if isinstance(b, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and b.body and isinstance(b.body[0], ast.Expr) and isinstance(b.body[0].value, ast.Constant)}
        hits = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names
                       and id(n) not in docs})
        if hits:
            out[name] = hits
    return out


def long_files() -> list[tuple[int, str]]:
    return sorted((n, str(p.relative_to(ROOT))) for p in modules().values()
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)


def harness_top_modules() -> list[str]:
    return sorted(p.name for p in PACKAGES["hybridkv_bench"].glob("*.py") if p.name != "__init__.py")


def test_no_import_cycles():
    assert import_cycles() == []


def test_no_import_cycles_in_the_library_type_only_imports_included():
    """A cycle through a type-only import still ties the two modules' layers together. (The L2 specs open their
    adapters by name, through the registry, so that an adapter may name its spec's type.)"""
    assert [c for c in import_cycles(typing=True) if c[0].startswith("hybridkv.")] == []


def test_no_import_cycles_in_the_harness_and_kernels_type_only_imports_included():
    """The harness's scenario.spec <-> engines <-> workloads loop and microbench's compute_beside <-> compute_load <->
    copy_loop were such cycles: registries name their kinds by "module:attr" strings, a workload's checks get the
    server and the engine kind's traits rather than the scenario, and the compute load types the sizes it reads."""
    assert [c for c in import_cycles(typing=True)
            if any(m.startswith(("hybridkv_bench.", "hybridkv_kernels.")) for m in c)] == []


def test_the_harness_folders_import_one_way():
    """The harness's rooms (each folder under hybridkv_bench and each top module) import each other in no loop, so
    they stack in one order with no up-import: a scenario decodes through the engines and the workload kinds,
    which build on the tables below them (`strict`, `model_shape`, `prefill`, `server_spec`). A loop of rooms
    needs no loop of files: `workloads` importing `scenario.strict` while `scenario.spec` imported the workload
    registry was one."""
    loops = harness_room_cycles()
    assert loops == [], "\n".join(f"{group}: {', '.join(room_ties(group))}" for group in loops)


def test_the_server_is_only_layer_folders():
    loose = sorted(p.name for p in PACKAGES["hybridkv"].joinpath("server").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    folders = sorted(p.name for p in PACKAGES["hybridkv"].joinpath("server").iterdir()
                     if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(SERVER_LAYERS)


def test_server_imports_only_run_downwards():
    assert upward_imports() == []


def test_hybridkv_top_is_folders_and_the_operator_command():
    loose = sorted(p.name for p in PACKAGES["hybridkv"].glob("*.py"))
    assert loose == sorted(CORE_TOP)
    for folder in CORE_LAYERS:
        assert PACKAGES["hybridkv"].joinpath(folder, "__init__.py").is_file(), folder


def test_core_imports_only_run_downwards():
    assert core_imports_not_downwards() == []


def test_no_environment_read_below_the_edge():
    assert set(env_reads_below_the_edge()) <= ENV_READS_BELOW_THE_EDGE


def test_the_engine_never_imports_the_server():
    bad = [(a, b) for a, bs in import_graph().items() if a.startswith("hybridkv.engine") for b in bs
           if b.startswith("hybridkv.server")]
    assert bad == []


def test_the_core_never_imports_the_harness():
    bad = [(a, b) for a, bs in import_graph().items() if not a.startswith("hybridkv_bench") for b in bs
           if b.startswith("hybridkv_bench")]
    assert bad == []


def test_the_harness_top_package_is_small():
    top = harness_top_modules()
    assert len(top) <= MAX_HARNESS_TOP, top


def test_no_source_file_is_over_600_lines():
    assert long_files() == []


def test_wire_formats_are_named_in_few_modules():
    mods = format_literal_modules()
    assert len(mods) <= MAX_FORMAT_MODULES, mods


if __name__ == "__main__":
    import sys

    sys.path[:0] = [str(ROOT / "reference_impl"), str(ROOT / "kernels"), str(ROOT / "harness")]
    print("import cycles:", import_cycles() or "none")
    print("import cycles, type-only imports included:", import_cycles(typing=True) or "none")
    print("upward imports between the server's layers:", upward_imports() or "none")
    print("core imports that do not run downwards:", core_imports_not_downwards() or "none")
    print("harness rooms that import each other round:", harness_room_cycles() or "none")
    print("harness top modules:", len(harness_top_modules()))
    print("files over", MAX_LINES, "lines:", long_files() or "none")
    fm = format_literal_modules()
    print("modules naming wire formats:", len(fm), fm)
    print("import edges:", sum(len(v) for v in import_graph().values()), "between", len(modules()), "modules")
