"""Reading a scenario file: TOML decoded strictly into `spec.Scenario` (an unknown or misspelt key is an
error naming the key path and the file), then validated against the model's layout (`sizes.validate`)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hybridkv_bench.scenario.sizes import scaled, validate
from hybridkv_bench.scenario.spec import Scenario, ScenarioError, convert

# ---- decoding ------------------------------------------------------------------------------------

# a workload table's error carries its path inside the table, then the table's own: `... - at `$.x` - at `$.w[1]``
_MSGSPEC_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<inner>[^`]*)`)?(?: - at `(?P<path>[^`]*)`)?$", re.S)


def _describe(e: msgspec.ValidationError) -> str:
    """msgspec's `Object contains unknown field `x` - at `$.matrix`` as `unknown field `x` at $.matrix`."""
    m = _MSGSPEC_AT.match(str(e))
    assert m is not None
    msg = m["msg"].removeprefix("Object contains ").removeprefix("Object ")
    msg = msg[:1].lower() + msg[1:]
    path = m["inner"] if m["path"] is None else m["path"] + (m["inner"] or "$").removeprefix("$")
    return f"{msg} at {path}" if path else msg


def toml_error(source: str, text: str, e: tomllib.TOMLDecodeError) -> str:
    """The TOML error with a line number, also for errors at the end of the text (tomllib gives none there)."""
    msg = str(e)
    if "at end of document" in msg:
        lines = text.splitlines() or [""]
        msg = msg.replace("at end of document", f"at end of document: line {len(lines)}, column {len(lines[-1]) + 1}")
    return f"{source}: invalid TOML: {msg}"


def decode_scenario(data: dict | str, source: str = "<string>") -> Scenario:
    """Decode a scenario from TOML text or an already-parsed table, and validate it."""
    if isinstance(data, str):
        text = data
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ScenarioError(toml_error(source, text, e)) from None
        except RecursionError:  # tomllib parses nested arrays and inline tables recursively
            raise ScenarioError(f"{source}: nested too deeply to be a scenario") from None
    try:
        scenario = convert(data)
    except msgspec.ValidationError as e:
        raise ScenarioError(f"{source}: {_describe(e)}") from None
    except RecursionError:
        raise ScenarioError(f"{source}: nested too deeply to be a scenario") from None
    validate(scenario, source)
    return scenario


@dataclass(frozen=True, slots=True)
class ScenarioFile:
    """A scenario with where it came from: path, SHA-256 of the file, and the scale applied to it."""

    path: Path
    sha256: str
    scenario: Scenario
    scale: float = 1.0

    def scaled(self, factor: float) -> ScenarioFile:
        return dataclasses.replace(self, scenario=scaled(self.scenario, factor), scale=self.scale * factor)

    def record(self) -> dict:
        """The scenario as plain data for run.json, with its path, digest and scale."""
        return {**msgspec.to_builtins(self.scenario), "path": str(self.path), "sha256": self.sha256,
                "scale": self.scale}


def load_scenario(path: str | Path) -> ScenarioFile:
    """Read, decode and validate a scenario file. Its `name` must be the file's stem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read scenario file ({e.strerror})") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not UTF-8 text") from None
    scenario = decode_scenario(text, str(path))
    if scenario.name != path.stem:
        # Baselines and reports identify a scenario by name; two files with one name would mix them.
        raise ScenarioError(f"{path}: name {scenario.name!r} must equal the file name {path.stem!r}")
    return ScenarioFile(path=path, sha256=hashlib.sha256(raw).hexdigest(), scenario=scenario)


def find_scenarios(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.toml"))
