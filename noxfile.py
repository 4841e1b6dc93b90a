"""Sessions: `nox` runs the default ones (tests, lint). The CPU sessions share one environment,
.nox/shared (CPU torch + the project, editable), installed once and reused; GPU sessions (`gpu_tests`,
`gpu_bench`) are not default and use the machine's own torch."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import tomllib
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

SMOKE = "scenarios/smoke.toml"
SMOKE_BASELINE = "results/baselines/smoke-cpu.toml"
CPU_TORCH = ["torch==2.13.0"]  # the CPU wheel on this project's CPU machines; see README
EXTRAS = ".[test,triton,dev]"
SHARED = Path(".nox/shared")  # one environment for every CPU session: torch alone is ~2 GB


def _install(session: nox.Session) -> None:
    """Make the project importable in `session`: the shared environment for sessions without their own
    (venv_backend="none"), else an install into the session's own environment."""
    if session.venv_backend != "none":
        session.log(f"installing {', '.join(CPU_TORCH)} (CPU build) and the project ({EXTRAS}) into this session")
        session.install(*CPU_TORCH)
        session.install("-e", EXTRAS)
        return
    bin_dir = SHARED / "bin"
    stamp = SHARED / "installed.txt"
    # reinstall when what is asked for or the project's table (dependencies, entry points) changes
    project = json.dumps(tomllib.loads(Path("pyproject.toml").read_text())["project"], sort_keys=True)
    want = " ".join([*CPU_TORCH, EXTRAS, hashlib.sha256(project.encode()).hexdigest()[:16]])
    if not (bin_dir / "python").exists():
        session.log(f"creating the shared environment {SHARED}")
        session.run(sys.executable, "-m", "venv", str(SHARED), external=True)
    if not stamp.exists() or stamp.read_text() != want:
        session.log(f"installing into {SHARED}: {', '.join(CPU_TORCH)} (CPU build, ~2 GB once) and the project "
                    f"({EXTRAS}, editable)")
        pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q"]
        session.run(*pip, "--upgrade", "pip", external=True)
        session.run(*pip, *CPU_TORCH, external=True)
        session.run(*pip, "-e", EXTRAS, external=True)
        stamp.write_text(want)
    else:
        session.log(f"using the shared environment {SHARED} ({want.rsplit(' ', 1)[0]})")
    os.environ.pop("PYTHONPATH", None)  # the editable install maps the packages to this checkout
    session.env["VIRTUAL_ENV"] = str(SHARED.resolve())
    session.env["PATH"] = os.pathsep.join([str(bin_dir.resolve()), os.environ.get("PATH", "")])


def _run(session: nox.Session, *args: str, **kwargs) -> None:
    """session.run, the command taken from the shared environment when it is there: nox looks a command up
    on its own PATH, not on the session's."""
    exe = SHARED / "bin" / args[0]
    if session.venv_backend == "none" and exe.exists():
        args = (str(exe.resolve()), *args[1:])
    session.run(*args, external=True, **kwargs)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The default test suite on CPU, without the long end-to-end tests (`tests_slow` runs those)."""
    _install(session)
    # exit 5 (no test collected, e.g. a -k that matches nothing) is not a failure of the suite
    _run(session, "pytest", "-q", "-m", "not slow", *session.posargs, success_codes=[0, 5])


@nox.session(venv_backend="none")
def tests_slow(session: nox.Session) -> None:
    """The long end-to-end tests (marked slow), a separate CI step."""
    _install(session)
    _run(session, "pytest", "-q", "-m", "slow", *session.posargs, success_codes=[0, 5])


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over every package, the tests and scripts."""
    _install(session)
    _run(session, "ruff", "check", ".")


def _bench_and_gate(session: nox.Session) -> None:
    """Run the smoke scenario into a new run folder, write its report (verdict first), then gate it."""
    out = f"results/runs/smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    # exit 1 (a case failed) still leaves a complete run folder: the gate reads it and names the failure
    _run(session, "hybridkv", "bench", SMOKE, "--out", out, "--no-report", success_codes=[0, 1])
    _run(session, "hybridkv", "report", out, "--baseline", SMOKE_BASELINE)
    _run(session, "hybridkv", "gate", out, "--baseline", SMOKE_BASELINE)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The main job: the CPU smoke scenario end to end, its report and the gate's verdict.
    `nox -s bench -- SCENARIO [flags]` runs another scenario (no gate)."""
    _install(session)
    if session.posargs:
        _run(session, "hybridkv", "bench", *session.posargs)
    else:
        _bench_and_gate(session)


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """Write plots and report.md for a run folder: nox -s report -- RUN_DIR [--baseline FILE]."""
    _install(session)
    _run(session, "hybridkv", "report", *session.posargs)


@nox.session(venv_backend="none")
def gate(session: nox.Session) -> None:
    """Run the smoke scenario and gate it against the committed CPU baseline (what CI runs after the tests)."""
    _install(session)
    _bench_and_gate(session)


@nox.session(venv_backend="none")
def microbench(session: nox.Session) -> None:
    """pytest-benchmark microbenchmarks. The first run on a machine saves a baseline; later runs
    compare with it and fail when a mean is 25% slower (`-- --benchmark-save=NAME` to re-baseline)."""
    _install(session)
    import glob

    storage = "results/runs/benchmarks"  # per machine; results of one machine say nothing of another
    saved = glob.glob(f"{storage}/*/*.json")
    args = ["--benchmark-autosave"] if not saved else ["--benchmark-compare", "--benchmark-compare-fail=mean:25%"]
    _run(session, "pytest", "-q", "-m", "benchmark", "harness/tests/test_microbench.py", "--benchmark-enable",
                "--benchmark-only", f"--benchmark-storage={storage}", *args, *session.posargs)


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """The suite on a CUDA machine, with the machine's own torch and triton (not default)."""
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_backend="none")
def gpu_bench(session: nox.Session) -> None:
    """Kernel gather/scatter benchmark against the pinned-copy ceiling (not default)."""
    session.run("python", "kernels/bench/bench_gather_scatter.py", *session.posargs)
