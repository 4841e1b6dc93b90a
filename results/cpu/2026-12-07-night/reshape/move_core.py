"""The core's flat modules into folders that say what they are, as pure moves plus import updates: run from the
repository root on a clean tree, then `ruff check --fix --select I001 .` (import order) and commit. Re-runnable
after other branches merge: it moves what is still at the top and rewrites every reference it finds.

    python results/cpu/2026-12-07-night/reshape/move_core.py

hybridkv/model/   the model shape and what is stored of it: layouts, presets, chunk keys, the store/load policy, a
                  model's identity
hybridkv/wire/    what crosses the socket: the protocol's messages, packed integers, the wire formats, endpoints
hybridkv/memory/  host memory: the shared-memory arena and how much memory this process may still take
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

FOLDERS = {
    "model": ("layout", "presets", "keys", "policy", "model_identity"),
    "wire": ("protocol", "packed", "wire_formats", "endpoints"),
    "memory": ("arena", "memory_room"),
}
DOCS = {
    "model": "The model shape and what the cache stores of it: group layouts (`layout`), the model presets\n"
             "(`presets`, a module per family), chunk keys (`keys`), what a chunk stores or loads (`policy`),\n"
             "and a model's identity in namespaces (`model_identity`). Imports nothing else of hybridkv.",
    "wire": "What crosses the socket between engines and the server: the protocol's messages (`protocol`), packed\n"
            "integers (`packed`), the wire formats and their traits (`wire_formats`), where a server listens\n"
            "(`endpoints`). Imports only hybridkv.model below it.",
    "memory": "Host memory: the shared-memory L1 arena engines map (`arena`) and how much memory this process may\n"
              "still take (`memory_room`). Imports nothing else of hybridkv.",
}
PKG = Path("reference_impl/hybridkv")
TEXT = (".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".json", ".sh")


def main() -> None:
    where = {m: f for f, ms in FOLDERS.items() for m in ms}
    for folder, mods in FOLDERS.items():
        (PKG / folder).mkdir(exist_ok=True)
        init = PKG / folder / "__init__.py"
        if not init.exists():
            init.write_text(f'"""{DOCS[folder]}"""\n')
            subprocess.run(["git", "add", str(init)], check=True)
        for m in mods:
            if (PKG / f"{m}.py").exists():
                subprocess.run(["git", "mv", str(PKG / f"{m}.py"), str(PKG / folder / f"{m}.py")], check=True)
            elif (PKG / m / "__init__.py").exists():  # a package (presets/: one module per family)
                subprocess.run(["git", "mv", str(PKG / m), str(PKG / folder / m)], check=True)
    names = "|".join(where)
    dotted = re.compile(rf"\bhybridkv\.({names})\b(?![\w/])")
    from_top = re.compile(rf"\bfrom hybridkv import ({names})\b")
    path = re.compile(rf"\bhybridkv/({names})(\.py\b|/)")
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        p = Path(f)
        if f.startswith("results/") or p.suffix not in TEXT or not p.is_file():
            continue
        s = p.read_text()
        t = dotted.sub(lambda m: f"hybridkv.{where[m.group(1)]}.{m.group(1)}", s)
        t = from_top.sub(lambda m: f"from hybridkv.{where[m.group(1)]} import {m.group(1)}", t)
        t = path.sub(lambda m: f"hybridkv/{where[m.group(1)]}/{m.group(1)}{m.group(2)}", t)
        if t != s:
            p.write_text(t)
    # the wheel's package list (tests/test_slim_install.py checks it against the folders)
    py = Path("pyproject.toml")
    s = py.read_text()
    for folder in FOLDERS:
        if f'"hybridkv.{folder}"' not in s:
            s = s.replace('"hybridkv.server", ', f'"hybridkv.{folder}", "hybridkv.server", ', 1)
    py.write_text(s)


if __name__ == "__main__":
    main()
