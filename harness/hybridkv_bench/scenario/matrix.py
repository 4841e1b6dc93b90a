"""The matrix of transfer axes a scenario sweeps, made from the fields of the engine's `TransferAxes`.

The axes are declared once, in `hybridkv.engine.config.TransferAxes` (names, Literal types, defaults). A scenario's
`[matrix]` table lists values per axis (`wire_format = ["shm", "raw"]`) and its `exclude` entries each give some axes
one value, leaving out every case that matches them. `Matrix` and `Exclude` are built here from those fields at
import, so an axis added there is a matrix key and an exclude key here without a line written, typed as the engine
types it: a misspelt axis or a value outside its Literal is refused by the strict decoding, naming the key path
(`unknown field `wire_formt` at $.matrix`, `invalid enum value 'rdma' at $.matrix.wire_format[1]`). `commit` is the
one axis not swept: a scenario sets it for every case (`Scenario.commit`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

import msgspec
from hybridkv.engine.config import TransferAxes

from hybridkv_bench.strict import Strict

# The swept axes in case-name order (`shm-kernel-single-boundary-all`): the transfer axes but the commit.
AXES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TransferAxes) if f.name != "commit")
_TYPES: dict[str, Any] = typing.get_type_hints(TransferAxes)
# A matrix that names no value of an axis runs the engine's default, but for the stores' policy: a matrix without
# one stores every chunk's recurrent state, as the harness always has (its scenarios and their baselines were
# recorded so), where an engine stores it at the boundary only.
_UNSWEPT: dict[str, Any] = {**{f.name: f.default for f in dataclasses.fields(TransferAxes)}, "store_policy": "all"}
_STRICT = dict(module=__name__, frozen=True, kw_only=True, forbid_unknown_fields=True)


class ExcludeRule(Strict, frozen=True, omit_defaults=True):
    """What an exclude entry does; its fields (one optional value per axis) are made from TransferAxes below."""

    def __post_init__(self) -> None:
        if all(v is None for v in msgspec.structs.astuple(self)):
            raise ValueError("an exclude entry needs at least one axis")

    def matches(self, axes: TransferAxes) -> bool:
        """Whether every axis this entry gives has that value in `axes`."""
        values = axes.axes()
        return all(v is None or values[k] == v for k, v in msgspec.structs.asdict(self).items())


class Sweep(Strict, frozen=True):
    """What a matrix does; its fields (a tuple of values per axis, then `exclude`) are made from TransferAxes below."""

    def __post_init__(self) -> None:
        for axis in AXES:
            values = self.values(axis)
            if not values:
                raise ValueError(f"axis {axis} needs at least one value")
            if len(set(values)) != len(values):
                raise ValueError(f"axis {axis} lists a value twice: {list(values)}")

    def values(self, axis: str) -> tuple[Any, ...]:
        """The values the matrix lists for `axis` (one of AXES), in file order."""
        if axis not in AXES:
            raise KeyError(f"{axis!r} is not a matrix axis; the axes are {', '.join(AXES)}")
        return typing.cast(tuple[Any, ...], getattr(self, axis))


if TYPE_CHECKING:
    # What the type checker sees: the behaviour above and `exclude`; the axes are read through `Sweep.values`.
    Exclude = ExcludeRule

    class Matrix(Sweep, frozen=True):
        """Lists of values per axis; the cases are their product minus the `exclude` entries."""

        exclude: tuple[Exclude, ...] = ()
else:
    Exclude = msgspec.defstruct(
        "Exclude", [(a, _TYPES[a] | None, None) for a in AXES], bases=(ExcludeRule,), omit_defaults=True, **_STRICT)
    Exclude.__doc__ = "A partial assignment of axes; every case that matches all its given axes is left out."
    Matrix = msgspec.defstruct(
        "Matrix", [*((a, tuple[_TYPES[a], ...], (_UNSWEPT[a],)) for a in AXES), ("exclude", tuple[Exclude, ...], ())],
        bases=(Sweep,), **_STRICT)
    Matrix.__doc__ = "Lists of values per axis; the cases are their product minus the `exclude` entries."
