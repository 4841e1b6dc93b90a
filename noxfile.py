"""Sessions: `nox` runs the default ones (tests, lint). CPU machines get the CPU build of torch;
GPU sessions (`gpu_tests`, `gpu_bench`) are not default and use the machine's own torch."""

from __future__ import annotations

import time

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

SMOKE = "scenarios/smoke.toml"
SMOKE_BASELINE = "results/baselines/smoke-cpu.toml"
CPU_TORCH = ["torch==2.13.0"]  # the CPU wheel on this project's CPU machines; see README
EXTRAS = ".[test,triton,hf]"  # hf: the transformers engine's tests and scenario


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


def _bench_and_gate(session: nox.Session) -> None:
    """Run the smoke scenario into a new run folder (report included), then gate it against the CPU baseline."""
    out = f"results/runs/smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    # exit 1 (a case failed) still leaves a complete run folder: the gate reads it and names the failure
    session.run("hybridkv", "bench", SMOKE, "--out", out, success_codes=[0, 1])
    session.run("hybridkv", "gate", out, "--baseline", SMOKE_BASELINE)


@nox.session
def bench(session: nox.Session) -> None:
    """The main job: the CPU smoke scenario end to end, its report and the gate's verdict.
    `nox -s bench -- SCENARIO [flags]` runs another scenario (no gate)."""
    _install(session)
    if session.posargs:
        session.run("hybridkv", "bench", *session.posargs)
    else:
        _bench_and_gate(session)


@nox.session
def report(session: nox.Session) -> None:
    """Write plots and report.md for a run folder: nox -s report -- RUN_DIR."""
    _install(session)
    session.run("hybridkv", "report", *session.posargs)


@nox.session
def gate(session: nox.Session) -> None:
    """Gate the smoke scenario against the committed CPU baseline (what CI runs after the tests)."""
    _install(session)
    _bench_and_gate(session)


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


@nox.session
def fuzz(session: nox.Session) -> None:
    """Fuzz a real cache server: 100,000 mutated and garbage messages of every request type (about 5
    minutes on 2 cores), then a byte-exact store and retrieve; fails on a crash, an unanswered message,
    RSS growth after warm-up or wrong bytes. `-- --messages N --seed S` to change the run."""
    _install(session)
    session.run("python", "reference_impl/tests/fuzz_server.py", *(session.posargs or ["--messages", "100000"]))


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """The suite on a CUDA machine, with the machine's own torch and triton (not default)."""
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_backend="none")
def gpu_bench(session: nox.Session) -> None:
    """Kernel gather/scatter benchmark against the pinned-copy ceiling (not default)."""
    session.run("python", "kernels/bench/bench_gather_scatter.py", *session.posargs)
