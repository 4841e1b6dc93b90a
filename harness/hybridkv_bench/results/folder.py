"""Run folders: `run.json` (context, scenario, calibration, one entry per case) + `requests.csv`.

A run is written as it goes: run.json is replaced atomically after every case with
`"complete": false`, and only `finish()` writes `"complete": true`. A run that crashed or was
interrupted therefore still holds every finished case, and says it is incomplete; `load_run`
never lets such a folder pass for a finished run.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from hybridkv_bench.metrics import MODEL_COLUMNS, REQUEST_COLUMNS, Number, RequestRow
from hybridkv_bench.results.host import utc_now

SCHEMA = "hybridkv-run/1"
RUN_JSON = "run.json"
REQUESTS_CSV = "requests.csv"


class RunFolderError(Exception):
    """A folder that is not a run folder, or not one fit for what was asked of it."""


class NotARunFolder(RunFolderError):
    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"not a run folder: {path} ({reason})")


class IncompleteRunError(RunFolderError):
    def __init__(self, path: Path | str, detail: str):
        super().__init__(f"incomplete run: {path} ({detail})")


class CaseResult(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One matrix case on one workload: its axes, whether it ran, and its metrics (null: not measurable)."""

    name: str
    workload: str
    axes: dict[str, str]
    status: Literal["ok", "failed"]
    error: str | None = None
    metrics: dict[str, Number] = {}
    # Evidence behind a metric that is not a number, e.g. which CUDA libraries the server mapped.
    details: dict[str, Any] = {}

    @property
    def wire_format(self) -> str:
        """The case's wire format as run.json names it ("?" for a record without one)."""
        return self.axes.get("wire_format", "?")

    def __post_init__(self) -> None:
        if self.status == "failed" and not self.error:
            raise ValueError(f"case {self.name}/{self.workload} failed without an error message")
        if self.status == "ok" and self.error is not None:
            raise ValueError(f"case {self.name}/{self.workload} is ok but carries an error: {self.error}")

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.name}"


class RunRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole of run.json."""

    schema: str
    complete: bool
    context: dict[str, Any]
    scenario: dict[str, Any]
    calibration: dict[str, Any]
    cases: list[CaseResult]


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` so that a reader sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(msgspec.to_builtins(data), indent=2).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunWriter:
    """Writes one run folder. Use as a context manager, or call `finish()` when every case is in."""

    def __init__(self, folder: str | Path, scenario: dict[str, Any], context: dict[str, Any],
                 calibration: dict[str, Any] | None = None):
        self.folder = Path(folder)
        if self.folder.exists() and any(self.folder.iterdir()):
            raise RunFolderError(f"run folder {self.folder} exists and is not empty; not overwriting it")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.record = RunRecord(schema=SCHEMA, complete=False, context=dict(context), scenario=scenario,
                                calibration=dict(calibration or {}), cases=[])
        self._csv = open(self.folder / REQUESTS_CSV, "w", newline="")  # noqa: SIM115 (lives with the writer)
        self._rows = csv.writer(self._csv)
        self._rows.writerow(REQUEST_COLUMNS)
        self._csv.flush()
        self._save()

    def _save(self) -> None:
        write_json_atomic(self.folder / RUN_JSON, self.record)

    def set_calibration(self, calibration: dict[str, Any]) -> None:
        self.record.calibration = dict(calibration)
        self._save()

    def add_requests(self, rows: Iterable[RequestRow]) -> None:
        """Append request rows; floats are written with repr so the CSV round-trips exactly."""
        for r in rows:
            self._rows.writerow(msgspec.structs.astuple(r))
        self._csv.flush()

    def add_case(self, result: CaseResult) -> None:
        """Record a finished (or failed) case and rewrite run.json, still marked incomplete."""
        if any(c.key == result.key for c in self.record.cases):
            raise RunFolderError(f"case {result.key} was already recorded")
        self.record.cases.append(result)
        self._save()

    def finish(self) -> Path:
        """Mark the run complete. Only this ever writes `"complete": true`."""
        self._csv.close()
        self.record.context["finished_at"] = utc_now()
        self.record.complete = True
        self._save()
        return self.folder

    def close(self) -> None:
        """Stop writing without marking the run complete (what an interrupted run leaves)."""
        if not self._csv.closed:
            self._csv.close()
            self.record.context["finished_at"] = utc_now()
            self._save()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._csv.closed:
            self.finish()
        else:
            self.close()


@dataclass(frozen=True, slots=True)
class Run:
    """A run folder, read back."""

    folder: Path
    record: RunRecord
    requests: list[RequestRow]

    @property
    def complete(self) -> bool:
        return self.record.complete

    @property
    def scenario_name(self) -> str:
        return str(self.record.scenario.get("name", "?"))

    @property
    def cases(self) -> list[CaseResult]:
        return self.record.cases

    def rows_of(self, case: CaseResult) -> list[RequestRow]:
        return [r for r in self.requests if r.case == case.name and r.workload == case.workload]

    def expected_cases(self) -> int | None:
        """How many case entries the scenario asks for, or None if the scenario cannot be re-read."""
        from hybridkv_bench.scenario.spec import ScenarioError, convert, expand_matrix

        data = {k: v for k, v in self.record.scenario.items() if k not in ("path", "sha256", "scale")}
        try:
            scenario = convert(data)
            return len(expand_matrix(scenario)) * len(scenario.workloads)
        except (msgspec.ValidationError, ScenarioError):
            return None

    def incomplete_detail(self) -> str:
        n, total = len(self.cases), self.expected_cases()
        of = f" of {total}" if total is not None else ""
        return f"{n}{of} case results written; the run stopped before finishing"

    def require_complete(self) -> Run:
        if not self.complete:
            raise IncompleteRunError(self.folder, self.incomplete_detail())
        return self


# Columns added after runs were published; an older requests.csv without them still loads (defaults).
# The real-model columns are empty (None) in rows of the simulated engine.
OPTIONAL_COLUMNS = frozenset({"shared_tokens", "store_copy_s", "load_copy_s", *MODEL_COLUMNS, "engine", "gpu", "step",
                              "load_start_s", "store_start_s", "store_span_s", "tier"})


def _read_requests(path: Path, folder: Path) -> list[RequestRow]:
    try:
        return _parse_requests(path, folder)
    except UnicodeDecodeError as e:
        raise NotARunFolder(folder, f"{REQUESTS_CSV} is not UTF-8 text (byte {e.start} is "
                                    f"{e.object[e.start:e.start + 1]!r})") from None
    except csv.Error as e:  # a NUL byte, an unterminated quote at the end, a field over csv's size limit
        raise NotARunFolder(folder, f"{REQUESTS_CSV} is not CSV: {e}") from None


def _parse_requests(path: Path, folder: Path) -> list[RequestRow]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        known = tuple(header or ()) == tuple(c for c in REQUEST_COLUMNS if c in set(header or ()))
        if header is None or not known or set(REQUEST_COLUMNS) - set(header) - OPTIONAL_COLUMNS:
            raise NotARunFolder(folder, f"{REQUESTS_CSV} header is {header}, "
                                        f"expected {list(REQUEST_COLUMNS)}")
        rows = []
        for lineno, values in enumerate(reader, start=2):
            if len(values) != len(header):
                raise NotARunFolder(folder, f"{REQUESTS_CSV} line {lineno} has {len(values)} fields, "
                                            f"expected {len(header)}")
            try:
                fields = {k: v for k, v in zip(header, values, strict=True) if v != "" or k not in OPTIONAL_COLUMNS}
                rows.append(msgspec.convert(fields, RequestRow, strict=False))
            except msgspec.ValidationError as e:
                raise NotARunFolder(folder, f"{REQUESTS_CSV} line {lineno}: {e}") from None
    return rows


def load_run(path: str | Path) -> Run:
    """Read and validate a run folder. An incomplete run loads (its `complete` is False); callers
    that must not present it as finished call `require_complete()` or check `complete`."""
    folder = Path(path)
    if not folder.is_dir():
        raise NotARunFolder(folder, "no such directory" if not folder.exists() else "not a directory")
    rj = folder / RUN_JSON
    if not rj.is_file():
        raise NotARunFolder(folder, f"no {RUN_JSON}")
    try:
        raw = json.loads(rj.read_bytes())
    except (OSError, ValueError) as e:
        raise NotARunFolder(folder, f"{RUN_JSON} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise NotARunFolder(folder, f"{RUN_JSON} schema is {found!r}, expected {SCHEMA!r}")
    try:
        record = msgspec.convert(raw, RunRecord)
    except msgspec.ValidationError as e:
        raise NotARunFolder(folder, f"{RUN_JSON}: {e}") from None
    rc = folder / REQUESTS_CSV
    if rc.is_file():
        requests = _read_requests(rc, folder)
    elif record.complete:
        raise NotARunFolder(folder, f"a complete run without {REQUESTS_CSV}")
    else:
        requests = []
    return Run(folder=folder, record=record, requests=requests)
