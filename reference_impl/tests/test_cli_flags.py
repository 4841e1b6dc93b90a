"""The `hybridkv` command's front door: --version, and no flag taken by a prefix of its name (argparse's
abbreviation took `--l1-size 4` as the seed's `--l1-size-gb`), in the command and in every script's parser."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hybridkv
import pytest

ROOT = Path(__file__).resolve().parents[2]


def hybridkv_cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridkv.cli", *args], capture_output=True, text=True, timeout=120)


def test_version():
    r = hybridkv_cmd("--version")
    assert r.returncode == 0 and r.stdout == f"hybridkv {hybridkv.__version__}\n", r


@pytest.mark.parametrize("args, prefix", [(("serve", "--l1-size", "4"), "--l1-size"),
                                          (("serve", "--l1", "4"), "--l1"),
                                          (("status", "--time", "1"), "--time"),
                                          (("status", "--js"), "--js")])
def test_a_prefix_of_a_flag_is_refused(args, prefix):
    r = hybridkv_cmd(*args)
    assert r.returncode == 2
    assert f"unrecognized arguments: {prefix}" in r.stderr and "Traceback" not in r.stderr


def test_every_argument_parser_refuses_abbreviations():
    """Every ArgumentParser (and subparser) the project makes passes allow_abbrev=False."""
    offenders = []
    for tree_root in ("reference_impl", "harness", "kernels", "examples"):
        for path in sorted((ROOT / tree_root).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name not in ("ArgumentParser", "add_parser"):
                    continue
                ok = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in node.keywords)
                if not ok:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
