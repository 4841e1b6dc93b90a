"""The base of every struct the harness decodes from a file (a scenario's tables, each workload kind's, the model
overrides, the replay file's): keyword-only, frozen, and an unknown key is an error. It sits at the bottom of the
harness, below the scenario and everything a scenario decodes through."""

from __future__ import annotations

import msgspec


class Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Keyword-only, frozen; an unknown key is an error naming it."""


def positive(struct: msgspec.Struct, *fields: str) -> None:
    """Raise ValueError naming the first of `fields` of `struct` below 1."""
    for f in fields:
        v = getattr(struct, f)
        if v < 1:
            raise ValueError(f"{f} must be >= 1, got {v}")
