"""Sessions: `nox` runs the default ones (tests, lint). CPU machines get the CPU build of torch;
GPU sessions (`gpu_tests`, `gpu_bench`) are not default and use the machine's own torch."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

CPU_TORCH = ["torch==2.13.0"]  # the CPU wheel on this project's CPU machines; see README
EXTRAS = ".[test,triton]"


def _install(session: nox.Session) -> None:
    session.install(*CPU_TORCH)
    session.install("-e", EXTRAS)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite on CPU (Triton kernels under its interpreter)."""
    _install(session)
    # exit 5 (no test collected, e.g. a -k that matches nothing) is not a failure of the suite
    session.run("pytest", "-q", *session.posargs, success_codes=[0, 5])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every package, the tests and scripts."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Run a scenario (default: the CPU smoke scenario) and write its run folder and report."""
    _install(session)
    args = session.posargs or ["scenarios/smoke.toml"]
    session.run("hybridkv", "bench", *args)


@nox.session
def report(session: nox.Session) -> None:
    """Write plots and report.md for a run folder: nox -s report -- RUN_DIR."""
    _install(session)
    session.run("hybridkv", "report", *session.posargs)


@nox.session
def gate(session: nox.Session) -> None:
    """Gate the smoke scenario against the committed CPU baseline (what CI runs)."""
    _install(session)
    session.run("hybridkv", "bench", "scenarios/smoke.toml", "--out", "results/runs/ci-smoke")
    session.run("hybridkv", "gate", "results/runs/ci-smoke", "--baseline", "results/baselines/smoke-cpu.toml")


@nox.session
def microbench(session: nox.Session) -> None:
    """pytest-benchmark microbenchmarks. The first run on a machine saves a baseline; later runs
    compare with it and fail when a mean is 25% slower (`-- --benchmark-save=NAME` to re-baseline)."""
    _install(session)
    import glob

    storage = "results/runs/benchmarks"  # per machine; results of one machine say nothing of another
    saved = glob.glob(f"{storage}/*/*.json")
    args = ["--benchmark-autosave"] if not saved else ["--benchmark-compare", "--benchmark-compare-fail=mean:25%"]
    session.run("pytest", "-q", "-m", "benchmark", "harness/tests/test_microbench.py", "--benchmark-enable",
                "--benchmark-only", f"--benchmark-storage={storage}", *args, *session.posargs)


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """The suite on a CUDA machine, with the machine's own torch and triton (not default)."""
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_backend="none")
def gpu_bench(session: nox.Session) -> None:
    """Kernel gather/scatter benchmark against the pinned-copy ceiling (not default)."""
    session.run("python", "kernels/bench/bench_gather_scatter.py", *session.posargs)
